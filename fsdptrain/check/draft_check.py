"""check-metrics, the co-trained drafter (``drafter.enabled=true``): one more checked model, ``drafter/``.

Every packed layout runs the train step's own joint loss (``packed_policy_and_draft_loss``: one capture forward of
the policy, its loss and the draft loss, one backward of ``policy_loss + loss_weight * draft_loss``) through the same
``accumulate_gradients``; the drafter's gradient is read from it (the policy's is the actor's business: it is proven
the same with the drafter on or off by tests/unit/test_drafter.py). The draft normalisers are the
batch's draft positions and sequences with one (``count_draft_tokens_and_seqs``), with the layout's dp size, as the
train step builds them. The reference (:func:`reference_drafter`) runs each sequence alone through the unpacked
policy and drafter on sdpa (``reference_draft_outputs``), writes the loss share of each aggregation mode out from
the definitions with counts of its own mask (backward on ``loss_weight`` times it), and takes the metrics as plain
sums over every scored position.

Left out: the drafter has no padded path (its ``padded`` row runs the per-sequence oracle), and the off-policy pass
and the gradient-scale report cover the policy and the critic only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fsdptrain.check.draft_per_sequence import per_sequence_draft_loss, reference_draft_outputs, sequence_draft_mask
from fsdptrain.data.packing import pack_sequences
from fsdptrain.distributed.fsdp import held_grads
from fsdptrain.model.drafter import build_draft_vocab
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.draft_loss import ACCEPT_WINDOW, soft_cross_entropy_from_logits
from fsdptrain.rl.draft_loss import count_draft_tokens_and_seqs
from fsdptrain.metrics.typed import Metrics
from fsdptrain.rl.fused_loss import PolicyLossSettings
from fsdptrain.train.cotrain import CoTrainSettings, DraftLossSettings, packed_policy_and_draft_loss
from fsdptrain.train.step import MiniBatch

PREFIX = "drafter/"


@dataclass(frozen=True)
class DraftPartSettings:
    """What the drafter's checked losses need besides the data: the policy (the teacher and the features), its loss
    settings, the draft loss's settings and the batch's draft counts (positions, sequences with one)."""

    policy: torch.nn.Module
    policy_settings: PolicyLossSettings
    draft: DraftLossSettings
    num_tokens: int
    num_seqs: int

    def norms(self, policy_norms: LossNormalizers) -> LossNormalizers:
        """The draft normalisers next to the policy's: the batch's draft counts, the layout's dp size and factor."""
        return LossNormalizers(self.num_tokens, self.num_seqs, dp_size=policy_norms.dp_size,
                               loss_scale_factor=policy_norms.loss_scale_factor)


def _unprefixed(metrics: Metrics) -> Metrics:
    """The drafter's own metrics without `drafter/` (the layouts prefix every part's metrics with its name)."""
    return Metrics((name.removeprefix(PREFIX), m) for name, m in metrics.items() if name.startswith(PREFIX))


def packed_draft_part_loss(drafter, packed, targets, *, norms: LossNormalizers,
                           settings: DraftPartSettings) -> tuple[Tensor, Metrics]:
    """The train step's joint loss of one pack (what backward runs on: a forward of the FSDP policy whose backward
    never ran would leave its gradient state half done) and the drafter's metrics."""
    joint = CoTrainSettings(policy=settings.policy_settings, drafter=drafter, draft=settings.draft,
                            draft_norms=settings.norms(norms))
    loss, metrics = packed_policy_and_draft_loss(settings.policy, packed, targets, norms=norms, settings=joint)
    return loss, _unprefixed(metrics)


def per_sequence_draft_part_loss(drafter, prompts, responses, targets, *, norms: LossNormalizers,
                                 settings: DraftPartSettings) -> tuple[Tensor, Metrics]:
    """The per-sequence oracle (`per_sequence_draft_loss`) with the batch's draft normalisers, times loss_weight."""
    s = settings.policy_settings
    loss, metrics = per_sequence_draft_loss(settings.policy, drafter, prompts, responses, norms=settings.norms(norms),
                                            agg_mode=s.agg_mode, on=settings.draft.on, temperature=s.temperature,
                                            response_masks=[t.response_mask for t in targets])
    return settings.draft.loss_weight * loss, _unprefixed(metrics)


def draft_part_settings(policy, policy_settings: PolicyLossSettings, draft: DraftLossSettings,
                        batch: MiniBatch) -> DraftPartSettings:
    """The settings with the whole batch's draft counts (the product's count over one pack of every sequence)."""
    packed = pack_sequences(batch.prompts, batch.responses, list(range(batch.num_seqs)),
                            response_masks=batch.response_masks())
    num_tokens, num_seqs = count_draft_tokens_and_seqs(packed, on=draft.on)
    return DraftPartSettings(policy, policy_settings, draft, num_tokens, num_seqs)


def check_vocab(batch: MiniBatch, *, vocab_size: int, draft_vocab_size: int, on: str):
    """The checked drafter's vocabulary: the most frequent ids of the whole batch (the same on every rank)."""
    policy = [r if m is None else [t for t, k in zip(r, m.tolist()) if k]
              for r, m in zip(batch.responses, batch.response_masks())]
    seqs = [q if on == "response" else p + r for p, r, q in zip(batch.prompts, batch.responses, policy)]
    return build_draft_vocab([list(s) for s in seqs], vocab_size=vocab_size, draft_vocab_size=draft_vocab_size)


# ---- the reference ------------------------------------------------------------------------------------------------


def _share(ce_n: Tensor, mask_n: Tensor, mode: str, num_tokens: int, num_seqs: int, factor: Optional[float]) -> Tensor:
    """One sequence's share of the draft loss, from the definitions of docs/loss.md with the draft counts."""
    x = ce_n[mask_n].double()
    if x.numel() == 0:
        return ce_n.sum() * 0.0
    if mode == "token-mean":
        return x.sum() / num_tokens
    if mode == "token-sum":
        return x.sum()
    if mode == "seq-mean-token-sum":
        return x.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / num_seqs / factor
    if mode == "seq-mean-token-mean":
        return x.mean() / num_seqs
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def reference_drafter(drafter, batch: MiniBatch, settings: DraftPartSettings, loss_scale_factor: Optional[float],
                      counted=None) -> tuple[float, dict[str, float], dict[str, Tensor]]:
    """(draft loss, metrics, the drafter's full gradients), one sequence at a time; counts from its own mask, built
    from ``counted`` (per sequence the response tokens that count, the reference's: ``CheckBatch.counted_masks``;
    None: every response token)."""
    s, on = settings.policy_settings, settings.draft.on
    counted = counted if counted is not None else [None] * batch.num_seqs
    masks = [sequence_draft_mask(len(p), len(p) + len(r), on, m)
             for p, r, m in zip(batch.prompts, batch.responses, counted)]
    num_tokens = sum(int(m.sum()) for m in masks)
    num_seqs = sum(1 for m in masks if m.any())
    total, agree, accept, lengths = 0.0, 0.0, 0.0, []
    for prompt, response, mask_n in zip(batch.prompts, batch.responses, masks):
        draft_nD, teacher_nD = reference_draft_outputs(settings.policy, drafter, prompt, response,
                                                       temperature=s.temperature)
        ce_n, agree_n, accept_n = soft_cross_entropy_from_logits(draft_nD, teacher_nD)
        share = _share(ce_n, mask_n.to(ce_n.device), s.agg_mode, num_tokens, num_seqs, loss_scale_factor)
        (settings.draft.loss_weight * share).backward()
        total += float(share.detach())
        scored = [int(t) for t in torch.nonzero(mask_n).reshape(-1)]
        a = {t: float(accept_n[t]) for t in scored}
        agree += sum(float(agree_n[t]) for t in scored)
        accept += sum(a.values())
        for t in scored:  # a full window: t .. t + 2 all scored
            if all(t + k in a for k in range(ACCEPT_WINDOW)):
                lengths.append(sum(_prod(a[t + j] for j in range(k + 1)) for k in range(ACCEPT_WINDOW)))
    metrics = {PREFIX + "loss": total}
    if num_tokens:
        metrics[PREFIX + "top1_agreement"] = agree / num_tokens
        metrics[PREFIX + "accept_prob"] = accept / num_tokens
    if lengths:
        metrics[f"{PREFIX}expected_accept_len@{ACCEPT_WINDOW}"] = sum(lengths) / len(lengths)
    return total, metrics, held_grads(drafter)


def _prod(values) -> float:
    out = 1.0
    for v in values:
        out *= v
    return out
