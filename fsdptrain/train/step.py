"""One PPO update of one model on one mini-batch: agree packs, global normalisers, micro-batches, clip, step.

This is where the contracts of docs/architecture.md (the data path) and docs/loss.md meet, in this order:

1. the number of micro-batches is agreed world-wide (max over ranks) and this rank's packs are planned with it, so
   every rank runs the same forwards and FSDP's collectives line up (a rank with less work runs empty packs);
2. the mini-batch's global token and sequence counts are all-reduced once, before any forward;
3. each micro-batch runs one packed forward of the model and the fused loss of its outputs (the ``loss_fn``,
   fsdptrain/train/pack_losses.py) with those global counts (``agg_loss`` applies the dp-size factor), then backward;
   micro-batch losses are summed by backward, never averaged by their count;
4. the gradient's true global norm is taken, a non-finite one skips the step on every rank, else clip and step; a
   mini-batch with no counted token (global count 0, the same on every rank) is no step at all (docs/loss.md);
5. metrics merge by their kinds over micro-batches and then over ranks (``reduce_metrics``).

The policy's update takes an optional :class:`AuxiliaryLoss`: the hook through which an extension trains a loss on
the policy's forward (docs/architecture.md, "Extensions").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol, Sequence

import torch

from fsdptrain.data.context_split import padded_length
from fsdptrain.data.packing import PackedBatch, PackPlan, pack_sequences
from fsdptrain.data.shared_prompts import pack_shared_prompts
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import plan_agreed, plan_agreed_shared, reduce_metrics
from fsdptrain.distributed.context_parallel import NO_CONTEXT_PARALLEL, ContextGroup
from fsdptrain.model.loading import trainable_parameters
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.moe_aux_loss import MoeNormalizers, local_expert_counts
from fsdptrain.metrics.typed import Diagnostic, Mean, Metrics, Sum, merge_all
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.optim import NonFiniteGuard, clip_grad_norm_
from fsdptrain.train.pack_losses import packed_policy_loss, policy_forward, route_weights

LossFn = Callable[..., tuple[torch.Tensor, Metrics]]


@dataclass
class MiniBatch:
    """This rank's share of one mini-batch: its sequences and their response-aligned targets (whose
    ``response_mask`` says which response tokens count: docs/packing.md)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    targets: list[SeqTargets]
    routes: list[Optional[torch.Tensor]] = field(default_factory=list)
    """A mixture-of-experts policy's routes recorded at generation, per sequence (``Rollout.routes``, None where not
    recorded); empty: none (docs/moe.md "Routing replay")."""

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    def lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def response_masks(self) -> list[Optional[torch.Tensor]]:
        """Per sequence, the response tokens that count (its target's ``response_mask``; None: all of them)."""
        return [t.response_mask for t in self.targets]

    def num_counted_tokens(self) -> list[int]:
        """Per sequence, how many of its response tokens count: the sum of its mask (its length without one)."""
        return [len(r) if m is None else int(m.sum()) for r, m in zip(self.responses, self.response_masks())]


def local_counts(batch: MiniBatch) -> tuple[int, int]:
    """This rank's counted response tokens (the sum of the mask: the policy's, not rejected) and sequences with at
    least one (no collective)."""
    counted = batch.num_counted_tokens()
    return sum(counted), sum(1 for n in counted if n > 0)


def global_normalizers(batch: MiniBatch, *, dp_size: int, loss_scale_factor: Optional[float],
                       context: ContextGroup = NO_CONTEXT_PARALLEL) -> LossNormalizers:
    """The mini-batch's global counts (collective): counted response tokens (the mask's sum) and sequences with at
    least one such token. ``dp_size``: the ranks FSDP averages gradients over (dp x cp: `world.dp_size`). The ranks
    of a CP group hold the same batch: its first rank counts it and the others count nothing, so the world-wide sum
    counts each token once (docs/loss.md)."""
    counts = local_counts(batch) if context.rank == 0 else (0, 0)
    (norms,) = normalizers_of(counts, dp_size=dp_size, loss_scale_factor=loss_scale_factor)
    return norms


def normalizers_of(*local: tuple[int, int], dp_size: int, loss_scale_factor: Optional[float]
                   ) -> tuple[LossNormalizers, ...]:
    """Global normalisers from each loss's (tokens, sequences) on this rank, all in ONE all-reduce (collective)."""
    total = world.all_reduce_sum(torch.tensor([c for counts in local for c in counts], dtype=torch.float64))
    return tuple(LossNormalizers(global_num_tokens=int(total[2 * i]), global_num_seqs=int(total[2 * i + 1]),
                                 dp_size=dp_size, loss_scale_factor=loss_scale_factor) for i in range(len(local)))


@dataclass
class Accumulated:
    """What :func:`accumulate_gradients` did: the merged metrics of its micro-batches and ``loss``, the sum of the
    scalars backward ran on (this rank's share of the mini-batch loss, dp factor included)."""

    metrics: Metrics
    loss: float


def accumulate_gradients(model, batch: MiniBatch, *, loss_fn: LossFn, settings, norms: LossNormalizers,
                         token_budget: int, device: torch.device, plan: Optional[PackPlan] = None,
                         share_prompts: bool = False, context: ContextGroup = NO_CONTEXT_PARALLEL) -> Accumulated:
    """Forward and backward every micro-batch of this rank's share of the mini-batch; their merged metrics and the
    summed loss.

    Collective (the pack count is agreed) unless ``plan`` is given: then every rank must pass a plan with the same
    number of packs (check-metrics forces layouts this way). The gradients accumulate in the model; the caller clips
    and steps. ``share_prompts``: each pack's model forward holds each of its prompts once
    (`fsdptrain.data.shared_prompts`), and the agreed plan keeps a prompt's sequences together where the budget allows.
    ``context``: each pack's row is split over the CP group (padded to 2 x cp equal chunks); the group's ranks hold
    the same batch and compute the same loss and metrics, which its first rank alone reports (`replica_metrics`).
    """
    if plan is None:
        plan = agreed_plan(batch, token_budget, share_prompts=share_prompts)
    pack_fn = pack_shared_prompts if share_prompts else pack_sequences
    total, collected = 0.0, []
    extra = {"context": context} if context.enabled else {}
    lengths = batch.lengths()
    for pack in plan.packs:
        pad = {"pad_to": padded_length(sum(lengths[i] for i in pack), context.size)} if context.enabled else {}
        packed = pack_fn(batch.prompts, batch.responses, pack, response_masks=batch.response_masks(),
                         routes=batch.routes or None, **pad).to(device)
        loss, metrics = loss_fn(model, packed, [batch.targets[i] for i in pack], norms=norms, settings=settings,
                                **extra)
        loss.backward()  # micro-batch losses are summed (by backward), never averaged
        total += float(loss.detach())
        collected.append(metrics)
    work = Metrics({
        "fill_efficiency": Diagnostic(Mean(sum(plan.fill_efficiency), len(plan.fill_efficiency))),
        "micro_batches": Diagnostic(Sum(plan.num_packs)),
    })
    return Accumulated(replica_metrics(merge_all([*collected, work]), context), total)


def agreed_plan(batch: MiniBatch, token_budget: int, *, share_prompts: bool) -> PackPlan:
    """This rank's packs of the mini-batch, as many as the busiest rank's (collective)."""
    if share_prompts:
        return plan_agreed_shared(batch.prompts, batch.responses, token_budget)
    return plan_agreed(batch.lengths(), token_budget)


def moe_normalizers(model, batch: MiniBatch, plan: PackPlan, *, coef: float, device: torch.device,
                    share_prompts: bool = False, replay: bool = False) -> MoeNormalizers:
    """The mini-batch's load-balancing counts (collective; docs/moe.md, "The load-balancing loss"): C_le, the top-k
    selections of every layer's experts over the mini-batch's tokens (prompts and responses, never padding), and N,
    their number, summed over this rank's packs and all-reduced once, before the update's first forward.

    They are counted by a no-grad forward of the same packs on the same weights (the update's own routing, so the
    loss's value is transformers' over the whole mini-batch in one forward); under routing replay the forward
    routes the replayed experts (`fsdptrain.train.pack_losses.policy_forward`). ``coef`` 0: no loss, no pass."""
    if coef == 0:
        return MoeNormalizers(coef=0.0)
    pack_fn = pack_shared_prompts if share_prompts else pack_sequences
    counts_LE, num_tokens = None, 0.0
    with torch.no_grad():
        for pack in plan.packs:
            packed = pack_fn(batch.prompts, batch.responses, pack, response_masks=batch.response_masks(),
                             routes=batch.routes or None).to(device)
            _, routes = policy_forward(model, packed, record=True, replay=replay)
            weights_T = route_weights(packed).to(device)
            layers = sorted(routes.indices)
            local = local_expert_counts([routes.indices[i] for i in layers], weights_T,
                                        routes.logits[layers[0]].shape[-1])
            counts_LE = local if counts_LE is None else counts_LE + local
            num_tokens += float(weights_T.sum())
    total = world.all_reduce_sum(torch.cat([counts_LE.reshape(-1).cpu(), torch.tensor([num_tokens],
                                                                                       dtype=torch.float64)]))
    return MoeNormalizers(coef=coef, expert_counts_LE=total[:-1].reshape(counts_LE.shape), num_tokens=int(total[-1]))


def with_moe_counts(norms: LossNormalizers, model, batch: MiniBatch, plan: PackPlan, *, coef: float,
                    device: torch.device, share_prompts: bool = False, replay: bool = False) -> LossNormalizers:
    """``norms`` with an MoE policy's load-balancing counts of the mini-batch (:func:`moe_normalizers`,
    collective)."""
    return replace(norms, moe=moe_normalizers(model, batch, plan, coef=coef, device=device,
                                              share_prompts=share_prompts, replay=replay))


def replica_metrics(metrics: Metrics, context: ContextGroup) -> Metrics:
    """The metrics this rank adds to the world-wide reduction: all of them, or, on a CP group's ranks after its
    first (which computed the same numbers over the same rows), each metric's identity, so each counts once."""
    if context.rank == 0:
        return metrics
    return Metrics((name, metric.empty()) for name, metric in metrics.items())


@dataclass
class StepOutcome:
    """What an optimizer step did: the pre-clip global grad norm, whether it was skipped, the normalisers used, and
    the typed per-step facts of an auxiliary loss's own step (empty without one)."""

    grad_norm: float
    skipped: bool
    norms: Optional[LossNormalizers] = None
    auxiliary: Metrics = field(default_factory=Metrics)


class AuxiliaryLoss(Protocol):
    """The hook for an auxiliary loss on the policy's forward (docs/architecture.md, "Extensions").

    The policy's update runs :meth:`forward` instead of its plain forward, once per pack: it returns what it captured
    (``final_hidden_TH`` among it, which the policy loss uses). The auxiliary loss of the same pack is added to the
    policy loss, so one backward trains both; it must reach the policy only through detached captures, so the
    policy's gradients stay those of the policy loss. It has its own global normalisers, counted on this rank by
    :meth:`local_counts` and all-reduced in the same call as the policy's. After the policy's optimizer step,
    :meth:`after_policy_step` takes its own optimizer's step (and any extra passes) and returns typed facts.
    """

    def forward(self, model, packed: PackedBatch): ...

    def local_counts(self, batch: MiniBatch, plan: PackPlan) -> tuple[int, int]: ...

    def loss_of(self, model, captured, packed: PackedBatch, *, norms: LossNormalizers,
             policy: PolicyLossSettings) -> tuple[torch.Tensor, Metrics]: ...

    def after_policy_step(self, model, batch: MiniBatch, plan: PackPlan, *, norms: LossNormalizers,
                          policy: PolicyLossSettings, token_budget: int, device: torch.device) -> Metrics: ...


@dataclass(frozen=True)
class WithAuxiliary:
    """The settings of :func:`policy_and_auxiliary_loss`: the policy loss's, the auxiliary loss and its global
    normalisers."""

    policy: PolicyLossSettings
    auxiliary: AuxiliaryLoss
    norms: LossNormalizers


def policy_and_auxiliary_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                              settings: WithAuxiliary) -> tuple[torch.Tensor, Metrics]:
    """policy_loss + auxiliary loss of one pack, from ONE forward of the policy (the auxiliary's capturing one); the
    metrics of both."""
    auxiliary = settings.auxiliary
    captured = auxiliary.forward(model, packed)
    loss, metrics = packed_policy_loss(model, packed, targets, norms=norms, settings=settings.policy,
                                       hidden_TH=captured.final_hidden_TH)
    aux_loss, aux_metrics = auxiliary.loss_of(model, captured, packed, norms=settings.norms, policy=settings.policy)
    return loss + aux_loss, metrics.merge(aux_metrics)


def optimizer_step(model, optimizer, *, grad_clip: float, guard: NonFiniteGuard) -> StepOutcome:
    """Clip to the true global norm and step, or skip the step on every rank when the norm is not finite."""
    grad_norm = clip_grad_norm_(trainable_parameters(model), grad_clip)
    skipped = guard.should_skip(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(grad_norm=float(grad_norm), skipped=skipped)


def minibatch_step(model, optimizer, norms: LossNormalizers, *, grad_clip: float, guard: NonFiniteGuard
                   ) -> StepOutcome:
    """:func:`optimizer_step` after a mini-batch whose loss had the global normalisers ``norms``, or no step at all
    when it had no counted token (``norms.global_num_tokens == 0``, the same on every rank: no collective).

    Such a mini-batch contributes zero loss and a zero gradient; stepping on it would still change the weights
    (AdamW decays them and moves them along its moments) and the optimizer's state (moments, step count), so it
    takes no step in any layout and on any number of ranks. Its gradient is dropped unread (zero by contract) and
    its norm is 0 (docs/loss.md, "A mini-batch with no counted token").
    """
    if norms.global_num_tokens == 0:
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm=0.0, skipped=False, norms=norms)
    outcome = optimizer_step(model, optimizer, grad_clip=grad_clip, guard=guard)
    outcome.norms = norms
    return outcome


def update_on_minibatch(model, optimizer, batch: MiniBatch, *, loss_fn: LossFn, settings, dp_size: int,
                        loss_scale_factor: Optional[float], token_budget: int, grad_clip: float,
                        guard: NonFiniteGuard, device: torch.device, auxiliary: Optional[AuxiliaryLoss] = None,
                        share_prompts: bool = False, context: ContextGroup = NO_CONTEXT_PARALLEL,
                        moe_coef: Optional[float] = None) -> tuple[Metrics, StepOutcome]:
    """One optimizer step of ``model`` on one mini-batch; returns the rank-reduced metrics and the step's outcome.

    With ``auxiliary`` (the policy only: ``loss_fn`` must be ``packed_policy_loss``), the same forwards and backward
    train the auxiliary loss too (:func:`policy_and_auxiliary_loss`), and after the policy's step comes the
    auxiliary's own (:meth:`AuxiliaryLoss.after_policy_step`). The metrics are the joint pass's. ``share_prompts``:
    see :func:`accumulate_gradients` (not with an auxiliary loss, whose forward reads the unshared row).
    ``moe_coef`` (an MoE policy's: `fsdptrain.train.setup.moe_aux_coef`; None for a dense model or the critic): the
    weight of the load-balancing loss, whose global counts join the normalisers before the first forward
    (:func:`moe_normalizers`); 0 keeps only the MoE metrics.
    """
    if auxiliary is None:
        norms = global_normalizers(batch, dp_size=dp_size, loss_scale_factor=loss_scale_factor, context=context)
        plan = None
        if moe_coef is not None:
            plan = agreed_plan(batch, token_budget, share_prompts=share_prompts)
            norms = with_moe_counts(norms, model, batch, plan, coef=moe_coef, device=device,
                                    share_prompts=share_prompts, replay=getattr(settings, "routing_replay", False))
        accumulated = accumulate_gradients(model, batch, loss_fn=loss_fn, settings=settings, norms=norms,
                                           token_budget=token_budget, device=device, share_prompts=share_prompts,
                                           context=context, plan=plan)
        outcome = minibatch_step(model, optimizer, norms, grad_clip=grad_clip, guard=guard)
        return reduce_metrics(accumulated.metrics), outcome
    assert loss_fn is packed_policy_loss, "an auxiliary loss trains with the policy loss only"
    assert moe_coef is None, "an MoE policy is refused with an auxiliary loss (fsdptrain/preflight.py)"
    assert not share_prompts, "shared prompts are refused with an auxiliary loss (fsdptrain/config/validate.py)"
    assert not context.enabled, "an auxiliary loss is refused with context parallelism (fsdptrain/config/validate.py)"
    plan = plan_agreed(batch.lengths(), token_budget)
    norms, aux_norms = normalizers_of(local_counts(batch), auxiliary.local_counts(batch, plan), dp_size=dp_size,
                                      loss_scale_factor=loss_scale_factor)
    joint = WithAuxiliary(policy=settings, auxiliary=auxiliary, norms=aux_norms)
    accumulated = accumulate_gradients(model, batch, loss_fn=policy_and_auxiliary_loss, settings=joint,
                                       norms=norms, token_budget=token_budget, device=device, plan=plan)
    outcome = minibatch_step(model, optimizer, norms, grad_clip=grad_clip, guard=guard)
    outcome.auxiliary = auxiliary.after_policy_step(model, batch, plan, norms=aux_norms, policy=settings,
                                                    token_budget=token_budget, device=device)
    return reduce_metrics(accumulated.metrics), outcome
