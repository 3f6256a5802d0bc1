"""AdamW, the learning-rate schedule, gradient clipping over DTensor gradients, and the non-finite step guard.

Departures from common practice, on purpose: weight decay applies to every trainable parameter (no norm/bias
exclusion, as verl does); the warmup's first step already uses lr / warmup_steps (no wasted step at lr 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from fsdptrain.config.schema import LR_SCHEDULES
from fsdptrain.distributed.world import any_flag
from fsdptrain.model.loading import trainable_parameters
from fsdptrain.run.console import log


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `model` (`trainable_parameters`: under LoRA the adapters only; sharded
    DTensors under FSDP2: the optimizer state is sharded with them).

    Torch's fused kernel (``fused=True``, on the CPU and CUDA): one pass over each parameter, its gradient and its two
    moments, where the default per-parameter loop runs about ten elementwise ops, several of which allocate a
    parameter-sized temporary (4x faster on SmolLM2's 135M parameters on one CPU thread, docs/sft-vs-trl.md). The same
    AdamW update; its rounding differs from the loop's by about one fp32 ulp of the weights."""
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    params = trainable_parameters(model)
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameter")
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps, fused=True)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """The multiplier of the base learning rate for optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup_steps for step < warmup_steps. Then "constant": 1; "cosine": with
    progress p = (step - warmup_steps) / max(1, total_steps - warmup_steps) clamped to [0, 1],
    min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2, i.e. 1 right after warmup and min_lr_ratio at
    total_steps (and after).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
) -> LambdaLR:
    """Linear warmup then cosine decay to min_lr_ratio x lr, or constant (`lr_factor`). Call `.step()` once after
    each optimizer step, skipped steps included (the schedule counts training steps, not successful updates)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        return lr_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule, min_lr_ratio=min_lr_ratio
        )

    return LambdaLR(optimizer, factor)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of at most `max_norm`; return the pre-clip global norm.

    The norm is over every gradient element once: torch computes per-shard norms as DTensors with a Partial
    placement on the shard dimension and Replicate on the HSDP replicate dimension, and `full_tensor()` reduces the
    partial one only (summing over replicas too would count each element dp_replicate times). Replicas hold
    identical gradients after FSDP2's all-reduce, so the result is the same on every rank; a gradient corrupted on
    one replica after that reduce would give replica groups different norms, which is why `NonFiniteGuard` still
    decides world-wide. Gradients on several meshes (the experts' of expert parallelism,
    fsdptrain/distributed/expert_parallel.py) are normed one mesh at a time and combined as sqrt(sum of squares).
    Returns a plain 0-dim fp32 tensor.
    Scaling as torch's: g *= max_norm / (norm + 1e-6) when that is < 1.
    max_norm None or <= 0: no clipping, the norm is still computed. A non-finite norm leaves gradients untouched
    (the step will be skipped, see `NonFiniteGuard`).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = [_global_norm(group) for group in by_mesh.values()]
    total_norm = (norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))).float()
    norm = float(total_norm)
    if max_norm is not None and max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    return total_norm


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of gradients that share one mesh (or none), reduced over its shards."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class NonFiniteGradientError(RuntimeError):
    """Raised when too many optimizer steps in a row had a non-finite gradient norm."""


class NonFiniteGuard:
    """Decides, world-wide, whether a step is skipped because its gradient norm is not finite; counts and warns.

    The norm from `clip_grad_norm_` is global over the shards (the same on every rank when replicas agree), so
    ranks would usually decide alike; the decision still goes through one `any_flag` all-reduce, so that it is the
    same on every rank even for a rank-local norm or an HSDP replica whose gradient went bad after the reduce (a
    test plants exactly that). After `max_in_a_row` consecutive skipped steps it raises NonFiniteGradientError;
    a finite step resets the run. `num_skipped` counts every skipped step (a SUM metric).
    """

    def __init__(self, max_in_a_row: int):
        if max_in_a_row < 1:
            raise ValueError(f"max_nonfinite_in_a_row must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.num_skipped = 0
        self.num_in_a_row = 0

    def should_skip(self, grad_norm: torch.Tensor | float) -> bool:
        """True (on every rank) if `grad_norm` is nan/inf on any rank: then zero the gradients and do not step.
        Collective: every rank must call it once per step."""
        norm = float(grad_norm)
        if not any_flag(not math.isfinite(norm)):
            self.num_in_a_row = 0
            return False
        self.num_skipped += 1
        self.num_in_a_row += 1
        message = (
            f"non-finite gradient norm ({norm} on this rank): optimizer step skipped on every rank "
            f"({self.num_in_a_row} in a row, {self.num_skipped} in total, limit {self.max_in_a_row} in a row)"
        )
        if self.num_in_a_row >= self.max_in_a_row:
            raise NonFiniteGradientError(
                f"{message}. Stopping: lower the learning rate, check the loss aggregation mode's gradient scale "
                f"and the clip threshold, or raise trainer.max_nonfinite_in_a_row"
            )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return True

    def state_dict(self) -> dict:
        return {"num_skipped": self.num_skipped, "num_in_a_row": self.num_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.num_skipped, self.num_in_a_row = int(state["num_skipped"]), int(state["num_in_a_row"])


GRAD_NORM_WARN_STEPS = 5


@dataclass
class GradNormWatch:
    """Warns when the pre-clip grad norm stays above ``factor x clip`` for several steps in a row."""

    factor: float
    clip: float
    name: str
    in_a_row: int = 0

    def observe(self, grad_norm: float) -> None:
        if self.clip <= 0:
            return
        self.in_a_row = self.in_a_row + 1 if grad_norm > self.factor * self.clip else 0
        if self.in_a_row == GRAD_NORM_WARN_STEPS:
            log(f"warning: {self.name} pre-clip grad norm has been above {self.factor:g} x grad_clip "
                f"({self.factor * self.clip:g}) for {GRAD_NORM_WARN_STEPS} steps (now {grad_norm:.4g}): clipping "
                f"dominates the update; lower the learning rate or use a mode whose scale is near 1")

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row = int(state["in_a_row"])
