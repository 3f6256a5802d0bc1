"""One PPO update of one model on one mini-batch: agree packs, global normalisers, micro-batches, clip, step.

This is where the contracts of docs/architecture.md (the data path) and docs/loss.md meet, in this order:

1. the number of micro-batches is agreed world-wide (max over ranks) and this rank's packs are planned with it, so
   every rank runs the same forwards and FSDP's collectives line up (a rank with less work runs empty packs);
2. the mini-batch's global token and sequence counts are all-reduced once, before any forward;
3. each micro-batch runs one packed forward and the fused loss with those global counts (``agg_loss`` applies the
   dp-size factor), then backward; micro-batch losses are summed by backward, never averaged by their count;
4. the gradient's true global norm is taken, a non-finite one skips the step on every rank, else clip and step;
5. metrics merge by their kinds over micro-batches and then over ranks (:func:`reduce_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from fsdptrain.data.packing import PackedBatch, PackPlan, pack_sequences
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import plan_agreed, reduce_metrics
from fsdptrain.distributed.fsdp import reshard_all
from fsdptrain.model.forward import final_hidden_states, value_token_outputs
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.metrics import Diagnostic, Mean, Metrics, Sum, merge_all
from fsdptrain.rl.packed_loss import (
    PolicyLossSettings,
    SeqTargets,
    ValueLossSettings,
    policy_loss_of_hidden,
    token_logprobs_entropy,
    value_loss_of_values,
)
from fsdptrain.train.cotrain import (
    CoTrainSettings,
    DraftLossSettings,
    global_normalizers_with_draft,
    local_draft_counts,
    packed_draft_refresh_loss,
    packed_policy_and_draft_loss,
)
from fsdptrain.train.optim import NonFiniteGuard, clip_grad_norm_

LossFn = Callable[..., tuple[torch.Tensor, Metrics]]


@dataclass
class MiniBatch:
    """This rank's share of one mini-batch: its sequences and their response-aligned targets."""

    prompts: list[list[int]]
    responses: list[list[int]]
    targets: list[SeqTargets]

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    def lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]


def policy_token_outputs(model, packed: PackedBatch, *, temperature: float, chunk_size: int,
                         compute_entropy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One forward of the policy over the packed row, then `token_logprobs_entropy` of its hidden states."""
    head = model.get_output_embeddings()
    return token_logprobs_entropy(final_hidden_states(model, packed), head.weight, head.bias, packed,
                                  temperature=temperature, chunk_size=chunk_size, compute_entropy=compute_entropy)


def packed_policy_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                       settings: PolicyLossSettings, hidden_TH: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, Metrics]:
    """The policy's forward over one pack (skipped when `hidden_TH`, the final hidden states of a forward the caller
    already ran, is given), then the fused policy loss of its hidden states (`fsdptrain.rl.packed_loss`)."""
    if hidden_TH is None:
        hidden_TH = final_hidden_states(model, packed)
    head = model.get_output_embeddings()
    return policy_loss_of_hidden(hidden_TH, head.weight, head.bias, packed, targets, norms=norms, settings=settings)


def packed_value_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                      settings: ValueLossSettings) -> tuple[torch.Tensor, Metrics]:
    """The critic's forward over one pack, then the clipped value loss of its values (`fsdptrain.rl.packed_loss`)."""
    return value_loss_of_values(value_token_outputs(model, packed), packed, targets, norms=norms, settings=settings)


def local_counts(batch: MiniBatch) -> tuple[int, int]:
    """This rank's response tokens and sequences with at least one (no collective)."""
    return sum(len(r) for r in batch.responses), sum(1 for r in batch.responses if len(r) > 0)


def global_normalizers(batch: MiniBatch, *, dp_size: int, loss_scale_factor: Optional[float]) -> LossNormalizers:
    """The mini-batch's global counts (collective): response tokens and sequences with at least one such token."""
    total = world.all_reduce_sum(torch.tensor(local_counts(batch), dtype=torch.float64))
    return LossNormalizers(global_num_tokens=int(total[0]), global_num_seqs=int(total[1]), dp_size=dp_size,
                           loss_scale_factor=loss_scale_factor)


@dataclass
class Accumulated:
    """What :func:`accumulate_gradients` did: the merged metrics of its micro-batches and ``loss``, the sum of the
    scalars backward ran on (this rank's share of the mini-batch loss, dp factor included)."""

    metrics: Metrics
    loss: float


def accumulate_gradients(model, batch: MiniBatch, *, loss_fn: LossFn, settings, norms: LossNormalizers,
                         token_budget: int, device: torch.device, plan: Optional[PackPlan] = None) -> Accumulated:
    """Forward and backward every micro-batch of this rank's share of the mini-batch; their merged metrics and the
    summed loss.

    Collective (the pack count is agreed) unless ``plan`` is given: then every rank must pass a plan with the same
    number of packs (check-metrics forces layouts this way). The gradients accumulate in the model; the caller clips
    and steps.
    """
    plan = plan if plan is not None else plan_agreed(batch.lengths(), token_budget)
    total, collected = 0.0, []
    for pack in plan.packs:
        packed = pack_sequences(batch.prompts, batch.responses, pack).to(device)
        loss, metrics = loss_fn(model, packed, [batch.targets[i] for i in pack], norms=norms, settings=settings)
        loss.backward()  # micro-batch losses are summed (by backward), never averaged
        total += float(loss.detach())
        collected.append(metrics)
    work = Metrics({
        "fill_efficiency": Diagnostic(Mean(sum(plan.fill_efficiency), len(plan.fill_efficiency))),
        "micro_batches": Diagnostic(Sum(plan.num_packs)),
    })
    return Accumulated(merge_all([*collected, work]), total)


@dataclass
class StepOutcome:
    """What an optimizer step did: the pre-clip global grad norm, whether it was skipped, and the normalisers used
    (with a co-trained drafter, `drafter` is the drafter's own step)."""

    grad_norm: float
    skipped: bool
    norms: Optional[LossNormalizers] = None
    drafter: Optional["StepOutcome"] = None


@dataclass
class DrafterUpdate:
    """A drafter co-trained with the policy: its sharded module, its own optimizer, clip and guard, its loss, and
    how many refresh passes follow each policy step (docs/drafter.md)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grad_clip: float
    guard: NonFiniteGuard
    loss: DraftLossSettings
    refresh_passes: int = 0


def optimizer_step(model, optimizer, *, grad_clip: float, guard: NonFiniteGuard) -> StepOutcome:
    """Clip to the true global norm and step, or skip the step on every rank when the norm is not finite."""
    grad_norm = clip_grad_norm_(model.parameters(), grad_clip)
    skipped = guard.should_skip(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(grad_norm=float(grad_norm), skipped=skipped)


def update_on_minibatch(model, optimizer, batch: MiniBatch, *, loss_fn: LossFn, settings, dp_size: int,
                        loss_scale_factor: Optional[float], token_budget: int, grad_clip: float,
                        guard: NonFiniteGuard, device: torch.device, drafter: Optional[DrafterUpdate] = None
                        ) -> tuple[Metrics, StepOutcome]:
    """One optimizer step of ``model`` on one mini-batch; returns the rank-reduced metrics and the step's outcome.

    With ``drafter`` (the policy only: ``loss_fn`` must be ``packed_policy_loss``), the same forwards and backward
    train the drafter too (`packed_policy_and_draft_loss`), and the drafter then takes its own clipped step; then
    come its refresh passes against the updated policy (:func:`refresh_drafter`). The metrics are the joint pass's:
    the drafter is scored before it learns from this mini-batch.
    """
    if drafter is None:
        norms = global_normalizers(batch, dp_size=dp_size, loss_scale_factor=loss_scale_factor)
        accumulated = accumulate_gradients(model, batch, loss_fn=loss_fn, settings=settings, norms=norms,
                                           token_budget=token_budget, device=device)
        outcome = optimizer_step(model, optimizer, grad_clip=grad_clip, guard=guard)
        outcome.norms = norms
        return reduce_metrics(accumulated.metrics), outcome
    assert loss_fn is packed_policy_loss, "a drafter co-trains with the policy loss only"
    plan = plan_agreed(batch.lengths(), token_budget)
    draft_counts = local_draft_counts(batch.prompts, batch.responses, plan, on=drafter.loss.on)
    norms, draft_norms = global_normalizers_with_draft(local_counts(batch), draft_counts, dp_size=dp_size,
                                                       loss_scale_factor=loss_scale_factor)
    joint = CoTrainSettings(policy=settings, drafter=drafter.module, draft=drafter.loss, draft_norms=draft_norms)
    accumulated = accumulate_gradients(model, batch, loss_fn=packed_policy_and_draft_loss, settings=joint,
                                       norms=norms, token_budget=token_budget, device=device, plan=plan)
    outcome = optimizer_step(model, optimizer, grad_clip=grad_clip, guard=guard)
    outcome.norms = norms
    outcome.drafter = optimizer_step(drafter.module, drafter.optimizer, grad_clip=drafter.grad_clip,
                                     guard=drafter.guard)
    outcome.drafter.norms = draft_norms
    refresh_drafter(model, batch, drafter, settings=joint, plan=plan, token_budget=token_budget, device=device)
    return reduce_metrics(accumulated.metrics), outcome


def refresh_drafter(model, batch: MiniBatch, drafter: DrafterUpdate, *, settings: CoTrainSettings, plan: PackPlan,
                    token_budget: int, device: torch.device) -> None:
    """`drafter.refresh_passes` drafter-only passes over the mini-batch, each a clipped step of the drafter, with the
    policy (already stepped) forward under no_grad as the teacher: the drafter catches up with the policy that
    generates the next rollouts. The policy's weights and gradients are not touched; its units are resharded after
    (`reshard_all`). Collective, on the joint pass's agreed plan."""
    for _ in range(drafter.refresh_passes):
        accumulate_gradients(model, batch, loss_fn=packed_draft_refresh_loss, settings=settings,
                             norms=settings.draft_norms, token_budget=token_budget, device=device, plan=plan)
        optimizer_step(drafter.module, drafter.optimizer, grad_clip=drafter.grad_clip, guard=drafter.guard)
    if drafter.refresh_passes:
        reshard_all(model)
