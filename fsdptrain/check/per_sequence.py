"""One sequence at a time: each sequence alone through the unpacked model (sdpa, full logits, plain log-softmax),
the forward the reference (:mod:`fsdptrain.check.reference`) runs, and the per-sequence loss path (the product's
``policy_loss``/``value_loss`` on each sequence with the mini-batch's global normalisers, summed). The slow,
obviously correct path that tests and check-metrics compare the fused packed loss against. An MoE policy's
load-balancing loss (docs/moe.md) is added per sequence from `fsdptrain.rl.moe_aux_loss` directly: each
sequence's share with the mini-batch's counts, every one of its tokens counted once."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.model.moe import Routes, routing
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import Metrics, merge_all
from fsdptrain.rl.fused_loss import SeqTargets, ValueLossSettings
from fsdptrain.rl.moe_aux_loss import MoeNormalizers, aux_loss_share, local_expert_counts, moe_metrics
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.rl.policy_loss import entropy_from_logits, policy_loss
from fsdptrain.rl.value_loss import value_loss


def _sequence_ids(prompt_ids: Sequence[int], response_ids: Sequence[int], device) -> Tensor:
    return torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=device)


def reference_policy_outputs(model, prompt_ids: Sequence[int], response_ids: Sequence[int], *,
                             temperature: float) -> tuple[Tensor, Tensor]:
    """One sequence through the unpacked model (sdpa, its own forward): response log-probs and entropy `[R]`.

    Uses the full logits and a plain log-softmax: the slow, obviously-correct path.
    """
    device = next(model.parameters()).device
    ids = _sequence_ids(prompt_ids, response_ids, device)
    num_prompt, num_response = len(prompt_ids), len(response_ids)
    with generation_attention(model):
        logits = model(input_ids=ids, use_cache=False).logits[0]
    scaled = logits[num_prompt - 1: num_prompt - 1 + num_response].float() / temperature
    targets_R = ids[0, num_prompt: num_prompt + num_response]
    logprobs_R = torch.log_softmax(scaled, dim=-1).gather(-1, targets_R[:, None])[:, 0]
    return logprobs_R, entropy_from_logits(scaled)


def reference_values(model, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> Tensor:
    """One sequence through the unpacked value model: values at its response-scoring positions `[R]`."""
    device = next(model.parameters()).device
    ids = _sequence_ids(prompt_ids, response_ids, device)
    num_prompt, num_response = len(prompt_ids), len(response_ids)
    with generation_attention(model):
        values = model(input_ids=ids, use_cache=False).logits[0, :, 0].float()
    return values[num_prompt - 1: num_prompt - 1 + num_response]


def route_layers(routes: Routes) -> tuple[list[Tensor], list[Tensor]]:
    """The recorded router logits and indices of a forward, layers in order."""
    layers = sorted(routes.indices)
    return [routes.logits[i] for i in layers], [routes.indices[i] for i in layers]


def sequence_outputs(model, prompt_ids: Sequence[int], response_ids: Sequence[int], *, temperature: float,
                     record: bool) -> tuple[Tensor, Tensor, Routes]:
    """`reference_policy_outputs` of one sequence and the routes of its forward (recorded when ``record``)."""
    with routing(model, record=record) as routes:
        logprobs_R, entropy_R = reference_policy_outputs(model, prompt_ids, response_ids, temperature=temperature)
    return logprobs_R, entropy_R, routes


def sequence_moe_terms(routes: Routes, norms: MoeNormalizers, *, dp_size: int = 1) -> tuple[Tensor, Metrics]:
    """``coef`` x one unpacked sequence's share of the load-balancing loss, and its MoE metrics."""
    logits, indices = route_layers(routes)
    ones = torch.ones(logits[0].shape[0], device=logits[0].device)
    counts_LE = local_expert_counts(indices, ones, logits[0].shape[-1])
    if not norms.trains:
        return torch.zeros((), device=ones.device), moe_metrics(counts_LE, None)
    share = aux_loss_share(logits, ones, norms, dp_size=dp_size)
    return norms.coef * share, moe_metrics(counts_LE, share, dp_size=dp_size)


def _mask_of(target: SeqTargets, like_R: Tensor) -> Tensor:
    """The sequence's tokens that count (its target's ``response_mask``; every one without)."""
    if target.response_mask is None:
        return torch.ones_like(like_R, dtype=torch.bool)
    return target.response_mask.to(device=like_R.device, dtype=torch.bool)


def per_sequence_policy_loss(model, prompts, responses, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                             settings: PolicyLossSettings) -> tuple[Tensor, Metrics]:
    """The reference: each sequence alone through the unpacked model, its loss with the global normalisers, summed.

    Summing per-sequence losses computed with the mini-batch's global counts is exact for every aggregation mode
    (each mode is a sum over sequences once its denominator is global), so this equals the packed loss.
    """
    total: Optional[Tensor] = None
    collected = []
    for prompt_ids, response_ids, target in zip(prompts, responses, targets):
        logprobs_R, entropy_R, routes = sequence_outputs(model, prompt_ids, response_ids,
                                                         temperature=settings.temperature,
                                                         record=norms.moe is not None)
        mask_R = _mask_of(target, logprobs_R)
        loss, metrics = policy_loss(
            logprobs_R[None], target.old_logprobs[None].to(logprobs_R), target.advantages[None].to(logprobs_R),
            mask_R[None], norms=norms, settings=settings,
            ref_logprobs=target.ref_logprobs[None].to(logprobs_R) if settings.use_reference else None,
            entropy=entropy_R[None],
            rollout_is_weights=target.is_weights[None].to(logprobs_R) if settings.use_is_weights else None,
        )
        if norms.moe is not None:  # an MoE policy: each sequence's share of the load-balancing loss (docs/moe.md)
            aux, aux_metrics = sequence_moe_terms(routes, norms.moe, dp_size=norms.dp_size)
            loss, metrics = loss + aux.to(loss.dtype), metrics.merge(aux_metrics)
        total = loss if total is None else total + loss
        collected.append(metrics)
    assert total is not None, "the reference needs at least one sequence"
    return total, merge_all(collected)


def per_sequence_value_loss(model, prompts, responses, targets: Sequence[SeqTargets], *, norms: LossNormalizers,
                            settings: ValueLossSettings) -> tuple[Tensor, Metrics]:
    """The value-loss reference: each sequence alone through the unpacked value model, summed (see above)."""
    total: Optional[Tensor] = None
    collected = []
    for prompt_ids, response_ids, target in zip(prompts, responses, targets):
        values_R = reference_values(model, prompt_ids, response_ids)
        mask_R = _mask_of(target, values_R)
        loss, metrics = value_loss(
            values_R[None], target.old_values[None].to(values_R), target.returns[None].to(values_R), mask_R[None],
            norms=norms, agg_mode=settings.agg_mode, cliprange_value=settings.cliprange_value,
        )
        total = loss if total is None else total + loss
        collected.append(metrics)
    assert total is not None, "the reference needs at least one sequence"
    return total, merge_all(collected)
