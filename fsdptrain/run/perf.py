"""Where a step's time goes: phase timers, throughput, model FLOPs and MFU, peak memory (docs/performance.md).

A :class:`StepTimer` is active for one training step; code anywhere under it marks its phases with
``with phase("generate"):`` without the timer being passed down (an inactive ``phase`` is a no-op, so evaluation and
tests that call the sources directly time nothing). Phases do not nest: an inner phase's time is taken out of the
outer one, so the phases and ``other`` add up to the step's wall time exactly.

Every number here is a typed DIAGNOSTIC metric (docs/metrics.md): a fact about how the work ran, skipped by every
comparison by its kind, never by its name. Each wraps a MAX: the wall times are rank 0's own (not reduced across
ranks, so that the phases add up to ``perf/step_s`` exactly; the MAX says that merging several ranks' timings keeps the
slowest), the throughputs are computed from them, and the peak memory is the max over ranks.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Optional

import torch

from fsdptrain.distributed import world
from fsdptrain.metrics.typed import Diagnostic, Max, Metrics

PHASES = ("generate", "reward", "experience", "update")

# Dense bf16 peak TFLOP/s of one device (vendor datasheets, without sparsity), matched on the CUDA device name.
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
                     "4090": 165.0, "V100": 125.0}

_active: list["StepTimer"] = []


class StepTimer:
    """Wall time of one step split into :data:`PHASES` and ``other``; use as a context manager around the step."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.total = 0.0
        self._start = 0.0
        self._stack: list[tuple[str, float]] = []

    def __enter__(self) -> "StepTimer":
        _active.append(self)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.total = time.perf_counter() - self._start
        _active.remove(self)

    def _push(self, name: str) -> None:
        now = time.perf_counter()
        if self._stack:  # pause the outer phase
            outer, since = self._stack[-1]
            self.seconds[outer] += now - since
        self._stack.append((name, now))

    def _pop(self) -> None:
        now = time.perf_counter()
        name, since = self._stack.pop()
        self.seconds[name] += now - since
        if self._stack:  # resume the outer phase
            self._stack[-1] = (self._stack[-1][0], now)

    def timings(self) -> dict[str, float]:
        """``perf/<phase>_s`` for each phase, ``perf/other_s`` (the rest) and ``perf/step_s`` (their sum), in
        seconds."""
        out = {f"perf/{name}_s": self.seconds[name] for name in PHASES}
        out["perf/other_s"] = max(self.total - sum(self.seconds.values()), 0.0)
        out["perf/step_s"] = sum(out.values())
        return out

    def metrics(self) -> Metrics:
        """:meth:`timings` as DIAGNOSTIC metrics (this rank's wall times)."""
        return diagnostics(self.timings())


def diagnostics(values: dict[str, float]) -> Metrics:
    """Plain numbers about how the work ran as ``Diagnostic(Max(value))`` metrics."""
    return Metrics({name: Diagnostic(Max(value)) for name, value in values.items()})


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Charge the block's wall time to ``name`` of the active step timer, if any."""
    assert name in PHASES, name
    timer = _active[-1] if _active else None
    if timer is None:
        yield
        return
    timer._push(name)
    try:
        yield
    finally:
        timer._pop()


# ---- FLOPs ----------------------------------------------------------------------------------------------------------


def matmul_params(config) -> int:
    """Weights that multiply every token (attention and MLP projections of every layer, the output head); the
    embedding lookup and the norms are left out."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return layers * (attention + mlp) + hidden * config.vocab_size


def forward_flops(config, lengths: Sequence[int]) -> float:
    """Forward FLOPs of packed causal sequences of the given lengths (docs/performance.md):
    ``sum_s 2 * N * s + 2 * L * H_q * d * s^2`` (QK^T and AV, causal so half of ``4 * L * H_q * d * s^2``)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n = matmul_params(config)
    attention = 2 * config.num_hidden_layers * heads * head_dim
    return float(sum(2 * n * s + attention * s * s for s in lengths))


def generation_flops(config, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> float:
    """Forward FLOPs of generating with a KV cache: the prompt once, then each new token against its context."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n = matmul_params(config)
    attention = 4 * config.num_hidden_layers * heads * head_dim
    total = forward_flops(config, prompt_lengths)
    for p, r in zip(prompt_lengths, response_lengths):
        total += sum(2 * n + attention * (p + j + 1) for j in range(r))
    return total


def peak_tflops(configured: Optional[float], device: torch.device) -> Optional[float]:
    """The configured peak, else the known peak of this CUDA device, else None (the CPU: no MFU)."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in KNOWN_PEAK_TFLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: the CUDA allocator's peak where there is one, else the peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def step_flops(config, prompt_lengths: Sequence[int], response_lengths: Sequence[int], *, generated: bool,
               policy_forwards: int, critic_forwards: int, policy_updates: int, critic_updates: int) -> float:
    """This rank's model FLOPs of one step: generation, the experience forwards and the updates (forward + backward
    = 3 forwards each); the critic counted as the policy's body with a one-output head."""
    import copy

    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    critic = copy.copy(config)
    critic.vocab_size = 1
    total = generation_flops(config, prompt_lengths, response_lengths) if generated else 0.0
    total += forward_flops(config, lengths) * (policy_forwards + 3 * policy_updates)
    total += forward_flops(critic, lengths) * (critic_forwards + 3 * critic_updates)
    return total


def throughput(timings: dict[str, float], *, result: dict, update_epochs: int, step_flops_local: float,
               peak: Optional[float], device: torch.device, world_size: int) -> Metrics:
    """Tokens per second, achieved TFLOP/s per rank, MFU (when the peak is known), peak memory (max over ranks), as
    DIAGNOSTIC metrics; ``timings`` are :meth:`StepTimer.timings`.

    Collective: one all-reduce sum (FLOPs) and one max (memory).
    """
    tokens = result["batch/num_response_tokens"] + result["batch/num_prompt_tokens"]
    out = {"perf/tokens_per_s": tokens / timings["perf/step_s"]}
    if timings["perf/generate_s"] > 0:
        out["perf/generated_tokens_per_s"] = result["batch/num_response_tokens"] / timings["perf/generate_s"]
    if timings["perf/update_s"] > 0:
        out["perf/trained_tokens_per_s"] = tokens * update_epochs / timings["perf/update_s"]
    flops = float(world.all_reduce_sum(torch.tensor([step_flops_local], dtype=torch.float64))[0])
    out["perf/tflops_per_rank"] = flops / world_size / timings["perf/step_s"] / 1e12
    if peak is not None:
        out["perf/mfu"] = out["perf/tflops_per_rank"] / peak
    mem = world.all_reduce_max(torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64))
    out["perf/peak_mem_gib"] = float(mem[0]) / 2**30
    return diagnostics(out)
