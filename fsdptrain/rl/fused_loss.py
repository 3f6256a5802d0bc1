"""The fused loss over a packed row's hidden states: per-token log-probs, entropy and values, then the loss.

Legend: `_T` per-token tensors of one packed row (length T, aligned with the input: position t scores token t+1 of
the same sequence), `_R` one sequence's response tokens, `_TH` `[T, H]`, `_VH` `[V, H]`.

The caller runs the model's forward once over the packed row `[1, T]` (fsdptrain/train/pack_losses.py: `rl/` imports no
model) and hands its final hidden states here; the output projection is applied chunk by chunk
(:func:`chunked_logprobs_entropy`), so neither the `[T, V]` logits nor their gradient exist at once. The loss is then
computed once over the row by the layout-aware policy and value losses with `cu_seqlens`: there is no Python loop
over the sequences of a pack. The per-sequence oracle that tests and check-metrics compare against is
fsdptrain/check/per_sequence.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.logprobs import chunked_logprobs_entropy
from fsdptrain.metrics.typed import Max, Mean, Metrics
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.rl.policy_loss import policy_loss
from fsdptrain.rl.value_loss import value_loss


class PackedRow(Protocol):
    """What the losses read of a packed row (`fsdptrain.data.packing.PackedBatch` is one; docs/packing.md)."""

    input_ids: Tensor
    labels: Tensor
    label_mask: Tensor
    response_positions: Tensor
    response_mask: Tensor
    cu_seqlens: Tensor

    @property
    def total_len(self) -> int: ...


@dataclass(frozen=True)
class ValueLossSettings:
    agg_mode: str
    cliprange_value: float


@dataclass(frozen=True)
class SeqTargets:
    """One sequence's response-aligned training targets (`_R`); optional fields are None when unused.

    Every tensor has one entry per response token, tool tokens included, so the layout never changes with the mask;
    ``response_mask`` (bool `[R]`; None = all ones) says which tokens count: the policy's (the rollout's
    `response_mask`) and not rejected (`algorithm.rollout_rejection`). Entries at mask 0 are 0 and never read.
    ``old_logprobs`` (``old_values``) None: the update is strictly on-policy and the experience pass was skipped; the
    loss takes the training forward's own detached outputs instead, which is what the pass would have given.
    """

    old_logprobs: Optional[Tensor]
    advantages: Tensor
    ref_logprobs: Optional[Tensor] = None
    old_values: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    is_weights: Optional[Tensor] = None
    """Rollout-correction importance weights (detached), with `algorithm.rollout_correction`."""
    response_mask: Optional[Tensor] = None
    """bool `[R]`: the response tokens that count (packing turns it into the row's `response_mask`); None: all."""
    generation_logprobs: Optional[Tensor] = None
    """The generating forward's log-prob of each response token (`Rollout.generation_logprobs`), carried only when
    the old log-prob pass is skipped, for `generation_gap_metrics`; a diagnostic the loss never reads."""


def scatter_responses(per_seq_R: Sequence[Tensor], packed: PackedRow, *, device=None) -> Tensor:
    """Place each sequence's response-aligned values at the row positions that score them; 0 elsewhere, and 0 where
    the row's `response_mask` is off (a tool's token: its entry is never read). `[T]`.

    The inverse of :func:`fsdptrain.data.packing.unpack_responses`: the response positions of a pack, in row order, are
    the sequences' response tokens back to back, so one masked assignment does it.
    """
    positions_T = packed.response_positions[0]
    device = device or positions_T.device
    out_T = torch.zeros(packed.total_len, dtype=torch.float32, device=device)
    if per_seq_R:
        values = torch.cat([v.reshape(-1).to(device=device, dtype=torch.float32) for v in per_seq_R])
        assert values.numel() == int(positions_T.sum()), "response values do not match the pack's response tokens"
        out_T[positions_T.to(device)] = values
        out_T = torch.where(packed.response_mask[0].to(device), out_T, torch.zeros((), device=device))
    return out_T


def old_or_current(old_R: Sequence[Optional[Tensor]], current_T: Tensor, packed: PackedRow) -> Tensor:
    """The old values of a pack `[T]`: scattered from the targets, or the current ones detached when the experience
    pass was skipped (every target of a run then has None; an empty pack has no targets and is all masked)."""
    if old_R and old_R[0] is None:
        assert all(o is None for o in old_R), "a pack mixes skipped and recomputed old values"
        return current_T.detach().float()
    return scatter_responses(list(old_R), packed, device=current_T.device)


def token_logprobs_entropy(hidden_TH: Tensor, head_weight_VH: Tensor, head_bias_V: Optional[Tensor],
                           packed: PackedRow, *, temperature: float, chunk_size: int, compute_entropy: bool = True
                           ) -> tuple[Tensor, Optional[Tensor]]:
    """Per-token log-prob of the next token and the policy's entropy over the packed row: `([T], [T] or None)`, from
    the final hidden states and the output head, at the response-scoring positions (`packed.response_mask`); 0 at
    every other position (prompt tokens, each sequence's last, the padding tail), which every loss masks.

    Only the `S` scored positions go through the output head (`_S`: those positions in row order): the head is a
    V-wide matmul per position plus a softmax over V, and most positions of a row are prompt. Each scored position's
    value is the same function of its own hidden state as over the whole row; the matmul's M dimension (and its
    chunks) is S instead of T, which may change the last bits of a value and of the head's gradient sum.
    """
    device = hidden_TH.device
    scored_S = packed.response_mask[0].to(device).nonzero().squeeze(1)
    targets_S = packed.labels[0].to(device).index_select(0, scored_S)
    logprobs_S, entropy_S = chunked_logprobs_entropy(
        hidden_TH.index_select(0, scored_S), head_weight_VH, targets_S, temperature=temperature,
        chunk_size=chunk_size, bias_V=head_bias_V, compute_entropy=compute_entropy,
    )
    return _at_positions(logprobs_S, scored_S, hidden_TH.shape[0]), (
        None if entropy_S is None else _at_positions(entropy_S, scored_S, hidden_TH.shape[0]))


def _at_positions(values_S: Tensor, positions_S: Tensor, total_len: int) -> Tensor:
    """`[T]`: `values_S` at `positions_S`, 0 elsewhere (differentiable in `values_S`)."""
    return values_S.new_zeros(total_len).index_copy(0, positions_S, values_S)


def policy_loss_of_pack(logprobs_T: Tensor, entropy_T: Optional[Tensor], packed: PackedRow,
                        targets: Sequence[SeqTargets], *, norms: LossNormalizers, settings: PolicyLossSettings
                        ) -> tuple[Tensor, Metrics]:
    """The policy loss of one pack (one micro-batch) from its per-token log-probs and entropy `[T]`
    (`token_logprobs_entropy`'s; under context parallelism gathered from the CP group's ranks), with the mini-batch's
    global normalisers, and its metrics: the targets scattered onto the row, then `policy_loss` with `settings`.

    `targets[i]` belongs to the pack's i-th sequence. The loss is this micro-batch's share of the mini-batch scalar
    (times dp_size, applied inside `agg_loss`): summing it over micro-batches and FSDP's mean over ranks give the
    whole mini-batch's loss.
    """
    device = packed.input_ids.device
    ref_T = is_weights_T = None
    if settings.use_reference:
        ref_T = scatter_responses([t.ref_logprobs for t in targets], packed, device=device)
    if settings.use_is_weights:
        is_weights_T = scatter_responses([t.is_weights for t in targets], packed, device=device)
    loss, metrics = policy_loss(
        logprobs_T,
        *_on_row(logprobs_T, [t.old_logprobs for t in targets], [t.advantages for t in targets], packed),
        norms=norms,
        settings=settings,
        cu_seqlens=packed.cu_seqlens,
        ref_logprobs=ref_T,
        entropy=entropy_T,
        rollout_is_weights=is_weights_T,
    )
    if settings.generation_gap:
        metrics = metrics.merge(generation_gap_metrics(logprobs_T, packed, targets))
    return loss, metrics


def generation_gap_metrics(logprobs_T: Tensor, packed: PackedRow, targets: Sequence[SeqTargets]) -> Metrics:
    """``rollout/logprob_diff/mean`` and ``/max``: |this forward - generating forward| log-prob over the row's
    counted tokens (the policy's) of the sequences whose targets carry ``generation_logprobs`` (the others are left
    out): a token-pooled MEAN (total and count) and a MAX, so summed over packs and ranks the value is the same at
    any packing and dp size. With the old log-prob pass skipped this forward scores the rollouts on the weights that
    generated them, which is what that pass (`fsdptrain.train.experience.logprob_diff_metrics`) would have
    compared; nothing carried: empty, never 0.0."""
    device = logprobs_T.device
    generated_T = scatter_responses([t.advantages.new_zeros(t.advantages.shape) if t.generation_logprobs is None
                                     else t.generation_logprobs for t in targets], packed, device=device)
    carried_T = scatter_responses([t.advantages.new_full(t.advantages.shape, float(t.generation_logprobs is not None))
                                   for t in targets], packed, device=device) > 0
    diff_T = (logprobs_T.detach().double() - generated_T.double()).abs()
    return Metrics({"rollout/logprob_diff/mean": Mean.of(diff_T, carried_T),
                    "rollout/logprob_diff/max": Max.of(diff_T, carried_T)})


def value_loss_of_pack(values_T: Tensor, packed: PackedRow, targets: Sequence[SeqTargets], *,
                       norms: LossNormalizers, settings: ValueLossSettings) -> tuple[Tensor, Metrics]:
    """The clipped value loss of one pack from its per-token values `[T]`, with the mini-batch's global normalisers,
    and its metrics."""
    return value_loss(
        values_T,
        *_on_row(values_T, [t.old_values for t in targets], [t.returns for t in targets], packed),
        norms=norms,
        agg_mode=settings.agg_mode,
        cliprange_value=settings.cliprange_value,
        cu_seqlens=packed.cu_seqlens,
    )


def _on_row(current_T: Tensor, old_R: Sequence[Optional[Tensor]], targets_R: Sequence[Tensor],
            packed: PackedRow) -> tuple[Tensor, Tensor, Tensor]:
    """What a loss of one pack reads beside its current per-token values `[T]`: the old ones (the current ones where
    a sequence has none: `old_or_current`), the per-sequence targets scattered onto the row, and the response mask."""
    device = packed.input_ids.device
    return (old_or_current(old_R, current_T, packed), scatter_responses(targets_R, packed, device=device),
            packed.response_mask[0])
