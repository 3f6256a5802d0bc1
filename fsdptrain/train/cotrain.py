"""The policy and its EAGLE-3 drafter in one train step: one policy forward, one backward (docs/drafter.md).

Legend: `_T` per-position tensors of one packed row, `_TH` `[T, H]`, `_DH` `[D, H]`.

    loss = policy_loss + loss_weight * draft_loss

The policy's forward runs once, through `capture_policy_features`: its final hidden state feeds the policy's chunked
log-probs (with the graph) and the drafter's teacher (detached); the feature layers and the embeddings reach the
drafter detached. So the policy's gradients are those of the policy loss alone, bit for bit; the drafter's come
from the draft loss alone. The draft loss has its own global normalisers (its mask is not the response mask),
counted over this rank's packs and all-reduced in the same call as the policy's counts (`global_normalizers_with_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from fsdptrain.data.packing import PackedBatch, PackPlan, pack_sequences
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import reshard_all
from fsdptrain.model.drafter import capture_policy_features, run_drafter, teacher_head_rows
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.draft_loss import count_draft_tokens_and_seqs, draft_loss, packed_draft_mask
from fsdptrain.metrics.typed import Mean, Metrics
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets, policy_loss_of_hidden
from fsdptrain.train.optim import NonFiniteGuard
from fsdptrain.train.step import MiniBatch, accumulate_gradients, minibatch_step


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
    loss, metrics = policy_loss_of_hidden(features.final_hidden_TH, head.weight, head.bias, packed, targets,
                                          norms=norms, settings=policy)
    d_loss, d_metrics = _draft_loss_of(model, features, packed, settings)
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
    d_loss, d_metrics = _draft_loss_of(model, features, packed, settings)
    return settings.draft.loss_weight * d_loss, d_metrics


def _draft_loss_of(model, features, packed: PackedBatch, settings: CoTrainSettings) -> tuple[Tensor, Metrics]:
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


def local_draft_counts(prompts, responses, plan: PackPlan, *, on: str, response_masks=None) -> tuple[int, int]:
    """(scored draft positions, sequences with one) over this rank's packs of the mini-batch (no collective);
    ``response_masks`` as in `pack_sequences` (None: every response token is the policy's)."""
    tokens = seqs = 0
    for pack in plan.packs:
        packed = pack_sequences(prompts, responses, pack, response_masks=response_masks)
        num_tokens, num_seqs = count_draft_tokens_and_seqs(packed, on=on)
        tokens, seqs = tokens + num_tokens, seqs + num_seqs
    return tokens, seqs


def global_normalizers_with_draft(policy_counts: tuple[int, int], draft_counts: tuple[int, int], *, dp_size: int,
                                  loss_scale_factor) -> tuple[LossNormalizers, LossNormalizers]:
    """The policy's and the drafter's global normalisers from this rank's counts, in ONE all-reduce (collective)."""
    total = world.all_reduce_sum(torch.tensor([*policy_counts, *draft_counts], dtype=torch.float64))
    policy = LossNormalizers(global_num_tokens=int(total[0]), global_num_seqs=int(total[1]), dp_size=dp_size,
                             loss_scale_factor=loss_scale_factor)
    draft = LossNormalizers(global_num_tokens=int(total[2]), global_num_seqs=int(total[3]), dp_size=dp_size,
                            loss_scale_factor=loss_scale_factor)
    return policy, draft


@dataclass
class DrafterUpdate:
    """A drafter co-trained with the policy, as the step's auxiliary loss (`fsdptrain.train.step.AuxiliaryLoss`):
    its sharded module, its own optimizer, clip and guard, its loss, and how many refresh passes follow each policy
    step (docs/drafter.md)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grad_clip: float
    guard: NonFiniteGuard
    loss: DraftLossSettings
    refresh_passes: int = 0

    def forward(self, model, packed: PackedBatch):
        """The policy's one forward, capturing the drafter's features and the final hidden states."""
        return capture_policy_features(model, packed, feature_layers=self.module.feature_layers)

    def local_counts(self, batch: MiniBatch, plan: PackPlan) -> tuple[int, int]:
        return local_draft_counts(batch.prompts, batch.responses, plan, on=self.loss.on,
                                  response_masks=batch.response_masks())

    def settings(self, policy: PolicyLossSettings, norms: LossNormalizers) -> CoTrainSettings:
        return CoTrainSettings(policy=policy, drafter=self.module, draft=self.loss, draft_norms=norms)

    def loss_of(self, model, captured, packed: PackedBatch, *, norms: LossNormalizers,
                policy: PolicyLossSettings) -> tuple[Tensor, Metrics]:
        """loss_weight * draft_loss of one pack and its `drafter/*` metrics."""
        d_loss, d_metrics = _draft_loss_of(model, captured, packed, self.settings(policy, norms))
        return self.loss.loss_weight * d_loss, d_metrics

    def after_policy_step(self, model, batch: MiniBatch, plan: PackPlan, *, norms: LossNormalizers,
                          policy: PolicyLossSettings, token_budget: int, device: torch.device) -> Metrics:
        """The drafter's clipped step, then its refresh passes (:func:`refresh_drafter`); its grad norm and global
        token count, each a MEAN over the step's optimizer steps."""
        outcome = minibatch_step(self.module, self.optimizer, norms, grad_clip=self.grad_clip, guard=self.guard)
        refresh_drafter(model, batch, self, settings=self.settings(policy, norms), plan=plan,
                        token_budget=token_budget, device=device)
        return Metrics({"drafter/grad_norm": Mean(outcome.grad_norm, 1),
                        "drafter/global_num_tokens": Mean(norms.global_num_tokens, 1)})


def refresh_drafter(model, batch: MiniBatch, drafter: DrafterUpdate, *, settings: CoTrainSettings, plan: PackPlan,
                    token_budget: int, device: torch.device) -> None:
    """`drafter.refresh_passes` drafter-only passes over the mini-batch, each a clipped step of the drafter, with the
    policy (already stepped) forward under no_grad as the teacher: the drafter catches up with the policy that
    generates the next rollouts. The policy's weights and gradients are not touched; its units are resharded after
    (`reshard_all`). Collective, on the joint pass's agreed plan."""
    for _ in range(drafter.refresh_passes):
        accumulate_gradients(model, batch, loss_fn=packed_draft_refresh_loss, settings=settings,
                             norms=settings.draft_norms, token_budget=token_budget, device=device, plan=plan)
        minibatch_step(drafter.module, drafter.optimizer, settings.draft_norms, grad_clip=drafter.grad_clip,
                       guard=drafter.guard)
    if drafter.refresh_passes:
        reshard_all(model)
