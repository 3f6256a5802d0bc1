"""The per-pack losses of every trained model: one forward of the model over a packed row (docs/packing.md), then
the loss of its outputs from `fsdptrain/rl/` (pure numerics), with the mini-batch's global normalisers.

Each has the signature the update calls (`fsdptrain.train.step.accumulate_gradients`'s ``loss_fn``):
``loss_fn(model, packed, targets, *, norms, settings) -> (loss, Metrics)``, where ``targets[i]`` belongs to the
pack's i-th sequence and ``settings`` is the loss's settings object, built once per run:

- the policy's forward inside the one routing call of its forwards (:func:`policy_forward`) and an MoE policy's
  load-balancing term (:func:`with_moe_terms`, docs/moe.md), for RL and SFT alike;
- RL: :func:`packed_policy_loss` (`fsdptrain.rl.pg_terms.PolicyLossSettings`) and :func:`packed_value_loss`
  (`fsdptrain.rl.fused_loss.ValueLossSettings`), each also under context parallelism;
- SFT: :func:`packed_sft_loss` (:class:`SftLossSettings`; `fsdptrain.rl.sft_loss.sft_loss`);
- the co-trained drafter (docs/drafter.md): :func:`packed_policy_and_draft_loss` (policy + drafter from one policy
  forward) and :func:`packed_draft_refresh_loss` (the drafter alone, the policy under no_grad), both
  :class:`CoTrainSettings`.

Legend: `_T` per-position tensors of one packed row, `_TH` `[T, H]`, `_DH` `[D, H]`, `_L` one context-parallel
rank's positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from fsdptrain.data.packing import OWN_ROUTE, PackedBatch, PaddedBatch
from fsdptrain.data.shared_prompts import SharedPromptPack
from fsdptrain.distributed.context_parallel import NO_CONTEXT_PARALLEL, ContextGroup, ContextShard, shard_row
from fsdptrain.model.drafter import capture_policy_features, run_drafter, teacher_head_rows
from fsdptrain.model.forward import final_hidden_states, value_token_outputs
from fsdptrain.model.moe import Routes, routing
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.draft_loss import draft_loss, packed_draft_mask
from fsdptrain.metrics.typed import Mean, Metrics
from fsdptrain.rl.moe_aux_loss import aux_loss_share, local_expert_counts, moe_metrics
from fsdptrain.rl.fused_loss import (
    SeqTargets,
    ValueLossSettings,
    policy_loss_of_pack,
    token_logprobs_entropy,
    value_loss_of_pack,
)
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.rl.sft_loss import sft_loss


# ---- the policy's forward and its routes (mixture of experts, docs/moe.md) -------------------------------------------


def policy_forward(model, packed: PackedBatch, *, record: bool, replay: bool = False) -> tuple[Tensor, Routes]:
    """The policy's final hidden states ``[T, H]`` over one pack, from its forward inside THE one routing call of the
    policy's forwards (:func:`pack_routing`; the experience's and the update's both come here): ``record`` when the
    load-balancing loss or the MoE metrics read the routes, ``replay`` to route the experts recorded at generation
    (``model.moe.routing_replay``). Nothing recorded: empty `Routes`; a dense model routes nothing."""
    with pack_routing(model, packed, replay=replay, record=record) as routes:
        hidden_TH = final_hidden_states(model, packed)
    return hidden_TH, routes if routes is not None else Routes()


def route_weights(batch: PackedBatch | PaddedBatch) -> Tensor:
    """How many of the batch's tokens each routed position stands for (`fsdptrain.rl.moe_aux_loss`'s ``w_t``, in the
    routers' token order): 1 for a real token, 0 for padding (a packed row's tail, a padded batch's masked
    positions); a shared-prompt row (`SharedPromptPack`) holds a prompt once for each of its sequences, whose tokens
    therefore weigh as many."""
    if isinstance(batch, PaddedBatch):
        return batch.attention_mask.reshape(-1).double()
    if isinstance(batch, SharedPromptPack):
        return torch.bincount(batch.model_row.source_T, minlength=batch.model_row.input_ids.shape[-1]).double()
    return (torch.arange(batch.total_len, device=batch.input_ids.device) < batch.num_tokens).double()


def moe_terms(routes: Routes, weights_T: Tensor, norms: LossNormalizers) -> tuple[Tensor, Metrics]:
    """``coef`` x one forward's share of the mini-batch's load-balancing loss (`fsdptrain.rl.moe_aux_loss`, with the
    global counts of ``norms.moe``; its routed tokens weighted by ``weights_T``) and the MoE metrics of its routes
    (the aux loss's, when it trains, and the expert load of its counted tokens)."""
    moe = norms.moe
    layers = sorted(routes.indices)
    weights_T = weights_T.to(routes.logits[layers[0]].device)
    counts_LE = local_expert_counts([routes.indices[i] for i in layers], weights_T,
                                    routes.logits[layers[0]].shape[-1])
    if not moe.trains:
        return torch.zeros((), device=weights_T.device), moe_metrics(counts_LE, None)
    share = aux_loss_share([routes.logits[i] for i in layers], weights_T, moe, dp_size=norms.dp_size)
    return moe.coef * share, moe_metrics(counts_LE, share, dp_size=norms.dp_size)


def with_moe_terms(loss: Tensor, metrics: Metrics, routes: Routes, batch: PackedBatch | PaddedBatch,
                   norms: LossNormalizers) -> tuple[Tensor, Metrics]:
    """``loss`` plus the forward's load-balancing term, ``metrics`` with the MoE metrics (:func:`moe_terms`, the
    tokens weighted by :func:`route_weights`); unchanged for a dense model (``norms.moe`` None)."""
    if norms.moe is None:
        return loss, metrics
    aux, aux_metrics = moe_terms(routes, route_weights(batch), norms)
    return loss + aux.to(loss.dtype), metrics.merge(aux_metrics)


# ---- RL: the policy and the critic -----------------------------------------------------------------------------------


def policy_token_outputs(model, packed: PackedBatch, *, temperature: float, chunk_size: int,
                         compute_entropy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One forward of the policy over the packed row (`policy_forward`), then `token_logprobs_entropy` of its hidden
    states."""
    logprobs_T, entropy_T, _ = routed_token_outputs(model, packed, temperature=temperature, chunk_size=chunk_size,
                                                    compute_entropy=compute_entropy, record=False, replay=False)
    return logprobs_T, entropy_T


def routed_token_outputs(model, packed: PackedBatch, *, temperature: float, chunk_size: int, compute_entropy: bool,
                         record: bool, replay: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], Routes]:
    """`policy_token_outputs` whose forward records its routes (``record``) or replays the recorded ones
    (``replay``, `policy_forward`), with those `Routes`: the old log-prob pass of an MoE policy."""
    head = model.get_output_embeddings()
    hidden_TH, routes = policy_forward(model, packed, record=record, replay=replay)
    logprobs_T, entropy_T = token_logprobs_entropy(hidden_TH, head.weight, head.bias, packed, temperature=temperature,
                                                   chunk_size=chunk_size, compute_entropy=compute_entropy)
    return logprobs_T, entropy_T, routes


@dataclass(frozen=True)
class LocalRows:
    """What `token_logprobs_entropy` reads of a row, at a context-parallel rank's positions (`[1, L]`)."""

    labels: torch.Tensor
    response_mask: torch.Tensor


def context_token_outputs(model, packed: PackedBatch, shard: ContextShard, *, temperature: float, chunk_size: int,
                          compute_entropy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`policy_token_outputs` under context parallelism: the forward and the head at this rank's positions, then
    the whole row's `[T]` log-probs and entropy gathered from the CP group (each rank's gradient: its positions')."""
    head = model.get_output_embeddings()
    local = LocalRows(shard.split.take(packed.labels), shard.split.take(packed.response_mask))
    logprobs_L, entropy_L = token_logprobs_entropy(final_hidden_states(model, packed, shard), head.weight, head.bias,
                                                   local, temperature=temperature, chunk_size=chunk_size,
                                                   compute_entropy=compute_entropy)
    return shard.gather_tokens(logprobs_L), None if entropy_L is None else shard.gather_tokens(entropy_L)


def packed_policy_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                       settings: PolicyLossSettings, hidden_TH: Optional[torch.Tensor] = None,
                       context: ContextGroup = NO_CONTEXT_PARALLEL) -> tuple[torch.Tensor, Metrics]:
    """The policy's forward over one pack (`policy_forward`; skipped when `hidden_TH`, the final hidden states of a
    forward the caller already ran, is given), then the fused policy loss of its hidden states
    (`fsdptrain.rl.fused_loss`), plus an MoE policy's load-balancing term (`with_moe_terms`, docs/moe.md). Under
    context parallelism (`context`) the forward runs on this rank's positions and the loss on the gathered row."""
    routes: Optional[Routes] = None
    shard = shard_row(packed, context) if context.enabled else None
    if shard is not None:
        assert hidden_TH is None, "an auxiliary loss is refused with context parallelism (fsdptrain/config/validate.py)"
        assert norms.moe is None, "an MoE policy is refused with context parallelism (fsdptrain/preflight.py)"
        with pack_routing(model, packed, replay=settings.routing_replay, record=settings.generation_gap,
                          shard=shard) as routes:
            logprobs_T, entropy_T = context_token_outputs(model, packed, shard, temperature=settings.temperature,
                                                          chunk_size=settings.chunk_size)
    else:
        if hidden_TH is None:
            hidden_TH, routes = policy_forward(model, packed, record=norms.moe is not None or settings.generation_gap,
                                               replay=settings.routing_replay)
        else:
            assert norms.moe is None, "an MoE policy is refused with an auxiliary loss (fsdptrain/preflight.py)"
        head = model.get_output_embeddings()
        logprobs_T, entropy_T = token_logprobs_entropy(hidden_TH, head.weight, head.bias, packed,
                                                       temperature=settings.temperature,
                                                       chunk_size=settings.chunk_size)
    loss, metrics = policy_loss_of_pack(logprobs_T, entropy_T, packed, targets, norms=norms, settings=settings)
    if settings.generation_gap:  # this forward stands in for the old log-prob pass, which measures the routes too
        metrics = metrics.merge(route_mismatch_metrics(routes, packed, shard))
    return with_moe_terms(loss, metrics, routes, packed, norms)


# ---- mixture of experts: routing replay --------------------------------------------------------------------------


@contextmanager
def pack_routing(model, packed: PackedBatch, *, replay: bool, record: bool,
                 shard: Optional[ContextShard] = None) -> Iterator[Optional[Routes]]:
    """The routing block around a policy forward of one pack (fsdptrain/model/moe.py `routing`; docs/moe.md
    "Routing replay"): with ``replay`` and the pack's recorded routes (`PackedBatch.routes`, on the model row; under
    context parallelism this rank's positions), each token goes to the experts generation chose (the router's own
    at `OWN_ROUTE` rows), its gate weights the current router's; with ``record``, the yielded `Routes`. Neither:
    nothing (None)."""
    replayed = packed.routes if replay else None
    if replayed is not None and shard is not None:
        replayed = shard.split.take(replayed, dim=1)
    if replayed is None and not record:
        yield None
        return
    with routing(model, record=record, replay=None if replayed is None else list(replayed)) as routes:
        yield routes


def route_mismatch_metrics(routes: Optional[Routes], packed: PackedBatch,
                           shard: Optional[ContextShard] = None) -> Metrics:
    """``moe/topk_differ/tokens``: the share of tokens at which some MoE layer's top-k experts of this forward's
    routers (their own choice, from their logits: before any replay) differ as a set from the ones recorded at
    generation; ``moe/topk_differ/layer_tokens``: the share of (token, layer) pairs that differ. Over the positions
    of the LOSS row (a shared prompt counts once per sequence, as unshared) that carry a record; MEANs, so summed
    over packs and ranks they mean the same under any packing and dp size; nothing recorded: empty, never 0.0.
    A dense model (no router): no metric."""
    if routes is None or not routes.logits:
        return Metrics({})
    layers = sorted(routes.logits)
    k = routes.indices[layers[0]].shape[-1]
    own_LTk = torch.stack([torch.softmax(routes.logits[i].detach().float(), dim=-1).topk(k, dim=-1).indices
                           for i in layers])
    recorded = packed.routes
    if recorded is None:
        recorded = torch.full_like(own_LTk, OWN_ROUTE)
    else:
        recorded = recorded.to(own_LTk.device).long()
        recorded = shard.split.take(recorded, dim=1) if shard is not None else recorded
    valid = (recorded >= 0).all(dim=-1).all(dim=0)
    differ_LT = (own_LTk.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1)
    layers_differ, valid = differ_LT.sum(dim=0).double(), valid.double()
    if shard is not None:  # the whole row on every rank of the group, as the losses see it
        layers_differ, valid = shard.gather_tokens(layers_differ), shard.gather_tokens(valid)
    if isinstance(packed, SharedPromptPack):
        layers_differ, valid = (v.index_select(0, packed.model_row.source_T) for v in (layers_differ, valid))
    else:
        layers_differ, valid = layers_differ[:packed.num_tokens], valid[:packed.num_tokens]
    counted = valid > 0
    return Metrics({"moe/topk_differ/tokens": Mean.of((layers_differ > 0).double(), counted),
                    "moe/topk_differ/layer_tokens": Mean(torch.where(counted, layers_differ, 0.0).sum(),
                                                         counted.sum() * len(layers))})


def packed_value_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                      settings: ValueLossSettings, context: ContextGroup = NO_CONTEXT_PARALLEL
                      ) -> tuple[torch.Tensor, Metrics]:
    """The critic's forward over one pack, then the clipped value loss of its values (`fsdptrain.rl.fused_loss`);
    under context parallelism the values of this rank's positions, gathered into the row."""
    if context.enabled:
        shard = shard_row(packed, context)
        values_T = shard.gather_tokens(value_token_outputs(model, packed, shard))
    else:
        values_T = value_token_outputs(model, packed)
    return value_loss_of_pack(values_T, packed, targets, norms=norms, settings=settings)


# ---- SFT -------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SftLossSettings:
    """What the SFT loss needs besides the data and the normalisers."""

    agg_mode: str
    chunk_size: int


@dataclass(frozen=True)
class DemoTarget:
    """A demonstration's per-token target: which response tokens are trained on (bool ``[R]``), as
    `fsdptrain.rl.fused_loss.SeqTargets.response_mask` is for a rollout; packing turns it into the row's mask."""

    response_mask: torch.Tensor


def packed_sft_loss(model, packed: PackedBatch, targets: Sequence[DemoTarget], *, norms: LossNormalizers,
                    settings: SftLossSettings) -> tuple[torch.Tensor, Metrics]:
    """The policy's forward over one pack (`policy_forward`), the fused log-probs of the trained tokens
    (`token_logprobs_entropy`, at temperature 1, no entropy) and their loss (`fsdptrain.rl.sft_loss.sft_loss`); the
    targets are in the row's mask. An MoE policy adds its load-balancing term (`with_moe_terms`, docs/moe.md)."""
    hidden_TH, routes = policy_forward(model, packed, record=norms.moe is not None)
    head = model.get_output_embeddings()
    logprobs_T, _ = token_logprobs_entropy(hidden_TH, head.weight, head.bias, packed, temperature=1.0,
                                           chunk_size=settings.chunk_size, compute_entropy=False)
    loss, metrics = sft_loss(logprobs_T, packed.response_mask[0], norms=norms, agg_mode=settings.agg_mode,
                             cu_seqlens=packed.cu_seqlens)
    return with_moe_terms(loss, metrics, routes, packed, norms)


# ---- the co-trained drafter ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftLossSettings:
    """The draft loss's knobs (fixed per run): which tokens train it, its weight, the attention backend."""

    on: str
    loss_weight: float
    backend: str


@dataclass(frozen=True)
class CoTrainSettings:
    """What `packed_policy_and_draft_loss` needs besides the data and the policy's normalisers: the policy loss's
    settings, the (sharded) drafter, the draft loss's settings and the mini-batch's draft normalisers."""

    policy: PolicyLossSettings
    drafter: nn.Module
    draft: DraftLossSettings
    draft_norms: LossNormalizers


def packed_policy_and_draft_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *,
                                 norms: LossNormalizers, settings: CoTrainSettings) -> tuple[Tensor, Metrics]:
    """policy_loss + loss_weight * draft_loss of one pack, and both losses' metrics (the drafter's named
    `drafter/*`). The agg mode, temperature and chunk size are the policy's."""
    drafter, policy = settings.drafter, settings.policy
    features = capture_policy_features(model, packed, feature_layers=drafter.feature_layers)
    head = model.get_output_embeddings()
    logprobs_T, entropy_T = token_logprobs_entropy(features.final_hidden_TH, head.weight, head.bias, packed,
                                                   temperature=policy.temperature, chunk_size=policy.chunk_size)
    loss, metrics = policy_loss_of_pack(logprobs_T, entropy_T, packed, targets, norms=norms, settings=policy)
    d_loss, d_metrics = draft_loss_of_features(model, features, packed, settings)
    return loss + settings.draft.loss_weight * d_loss, metrics.merge(d_metrics)


def packed_draft_refresh_loss(model, packed: PackedBatch, targets: Sequence[SeqTargets], *,
                              norms: LossNormalizers, settings: CoTrainSettings) -> tuple[Tensor, Metrics]:
    """loss_weight * draft_loss of one pack with the policy under no_grad: a refresh pass, run after the policy's
    optimizer step, so the teacher is the policy that generates the next rollouts (docs/drafter.md, "Refresh
    passes"). Same math, masks and normalisers as the joint pass; only the drafter gets gradients. `norms` and
    `targets` are unused (the draft loss's normalisers are `settings.draft_norms`): the signature is the loss
    functions' one."""
    with torch.no_grad():
        features = capture_policy_features(model, packed, feature_layers=settings.drafter.feature_layers)
    d_loss, d_metrics = draft_loss_of_features(model, features, packed, settings)
    return settings.draft.loss_weight * d_loss, d_metrics


def draft_loss_of_features(model, features, packed: PackedBatch, settings: CoTrainSettings) -> tuple[Tensor, Metrics]:
    """The draft loss of one pack and its metrics, from the captured (detached) policy features; the teacher is the
    policy's draft-vocabulary rows, read while its root unit is still unsharded after the forward."""
    drafter, policy = settings.drafter, settings.policy
    teacher_DH, teacher_bias_D = teacher_head_rows(model, drafter)
    with drafter.attention(settings.draft.backend):
        draft_hidden_TH = run_drafter(drafter, features, packed)
    mask_T = packed_draft_mask(packed, on=settings.draft.on).to(draft_hidden_TH.device)
    # the drafter's root unit keeps its weights unsharded after forward, so its head reads as a plain tensor here
    return draft_loss(
        draft_hidden_TH, drafter.lm_head.weight, features.final_hidden_TH, teacher_DH, mask_T,
        norms=settings.draft_norms, agg_mode=policy.agg_mode, cu_seqlens=packed.cu_seqlens,
        temperature=policy.temperature, chunk_size=policy.chunk_size, teacher_bias_D=teacher_bias_D,
    )
