"""A trained part: one model the run trains, with everything that trains it and saves with it.

A :class:`TrainedPart` owns its model, its AdamW, its learning-rate schedule, its non-finite guard and its grad-norm
watch, and knows its loss, the loss's settings and its clip. Both recipes are written over parts: the RL recipe
trains the policy's part and, with ``algorithm.use_critic``, the critic's (fsdptrain/train/rl.py), the SFT recipe
the policy's (fsdptrain/train/sft.py). A part updates itself on a mini-batch (:meth:`TrainedPart.update`, over
`fsdptrain.train.step.update_on_minibatch`), names its metrics and per-step facts, and lists itself for the
checkpoint under its name (:func:`checkpointed_parts`), so no recipe writes a policy/critic pair out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from fsdptrain.metrics.typed import Mean, Metrics
from fsdptrain.run.checkpointer import Checkpointed, Stateful
from fsdptrain.train.optim import GradNormWatch, NonFiniteGuard
from fsdptrain.train.step import AuxiliaryLoss, LossFn, MiniBatch, StepOutcome, update_on_minibatch


@dataclass
class TrainedPart:
    """One trained model and what trains it (see the module docstring)."""

    name: str
    """Its name in the checkpoint: the model, optimizer and scheduler are saved under it, the guard and the watch
    as ``<name>_guard`` and ``<name>_watch`` ("policy", "critic")."""
    prefix: str
    """The prefix of its logged metrics ("actor/", "critic/", "sft/")."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    guard: NonFiniteGuard
    watch: GradNormWatch
    loss_fn: LossFn
    """The loss of one pack (`fsdptrain.train.pack_losses`: the policy's, the critic's or the SFT loss)."""
    settings: object
    """What ``loss_fn`` needs besides the data and the normalisers."""
    grad_clip: float
    moe_coef: Optional[float] = None
    """An MoE policy's load-balancing loss weight (`fsdptrain.train.setup.moe_aux_coef`; 0: its metrics only); None
    for a dense model or the critic (docs/moe.md)."""

    def update(self, batch: MiniBatch, *, auxiliary: Optional[AuxiliaryLoss] = None, **layout
               ) -> tuple[Metrics, StepOutcome]:
        """One optimizer step on one mini-batch (collective): `update_on_minibatch` with this part's model, loss,
        clip and guard (``layout``: its dp size, loss scale factor, token budget, device, shared prompts, context
        group); the watch sees the pre-clip norm. Returns the rank-reduced metrics, unnamed, and the outcome."""
        metrics, outcome = update_on_minibatch(self.model, self.optimizer, batch, loss_fn=self.loss_fn,
                                               settings=self.settings, grad_clip=self.grad_clip, guard=self.guard,
                                               auxiliary=auxiliary, moe_coef=self.moe_coef, **layout)
        self.watch.observe(outcome.grad_norm)
        return metrics, outcome

    def named(self, metrics: Metrics) -> Metrics:
        """The loss's metrics under :attr:`prefix`; an auxiliary loss's, already named ``its_part/...``, keep their
        names."""
        return Metrics((name if "/" in name else self.prefix + name, metric) for name, metric in metrics.items())

    def facts(self, outcome: StepOutcome) -> Metrics:
        """The typed facts of one optimizer step: the pre-clip grad norm (``<prefix>grad_norm``), the global counts
        its loss was normalised by (``loss/global_num_tokens``, ``loss/global_num_seqs``: the mini-batch's, the same
        for every part) and an auxiliary loss's facts; each a MEAN over the step's optimizer steps."""
        return Metrics({f"{self.prefix}grad_norm": Mean(outcome.grad_norm, 1),
                        "loss/global_num_tokens": Mean(outcome.norms.global_num_tokens, 1),
                        "loss/global_num_seqs": Mean(outcome.norms.global_num_seqs, 1)}).merge(outcome.auxiliary)

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step (after the scheduler's steps so far)."""
        return self.optimizer.param_groups[0]["lr"]


def checkpointed_parts(parts: Iterable[TrainedPart], states: dict[str, Stateful]) -> Checkpointed:
    """Every part's model, optimizer and scheduler under its name, its guard and watch as ``<name>_guard`` and
    ``<name>_watch``, then the recipe's other ``states`` (docs/checkpointing.md)."""
    out = Checkpointed()
    for part in parts:
        out.models[part.name], out.optimizers[part.name], out.schedulers[part.name] = (
            part.model, part.optimizer, part.scheduler)
        out.states[f"{part.name}_guard"], out.states[f"{part.name}_watch"] = part.guard, part.watch
    out.states.update(states)
    return out
