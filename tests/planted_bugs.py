"""Bugs from the anchors' trainers, planted into the product for check-metrics' tests to catch.

Each ``plant_*`` takes the setter to use: ``monkeypatch.setattr`` in one process (tests/unit), plain ``setattr`` in a
``sitecustomize`` module on the ranks' Python path (tests/e2e).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdptrain.train import experience, loop, optim, step


@torch.no_grad()
def clip_by_local_shards(parameters, max_norm):
    """SkyRL #211: the grad norm over this rank's shards only, so each rank logs and clips by its own norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([g.to_local() if isinstance(g, DTensor) else g for g in grads]).float()
    if max_norm is not None and max_norm > 0 and max_norm / (float(norm) + 1e-6) < 1:
        for g in grads:
            g.mul_(max_norm / (float(norm) + 1e-6))
    return norm


def plant_grad_norm_over_local_shards(set_attr=setattr) -> None:
    set_attr(optim, "clip_grad_norm_", clip_by_local_shards)
    set_attr(step, "clip_grad_norm_", clip_by_local_shards)


def plant_normaliser_over_the_whole_step(set_attr=setattr) -> None:
    """TRL #6024: every mini-batch's loss normalised by the counts of the whole step, not of the mini-batch."""
    whole, update, normalizers = [], loop.Trainer.update, step.global_normalizers

    def update_whole(self, batches, on_policy):
        whole.append(step.MiniBatch([p for b in batches for p in b.prompts], [r for b in batches for r in b.responses],
                                    [t for b in batches for t in b.targets]))
        try:
            return update(self, batches, on_policy)
        finally:
            whole.clear()

    set_attr(loop.Trainer, "update", update_whole)
    set_attr(step, "global_normalizers", lambda batch, **kw: normalizers(whole[0] if whole else batch, **kw))


def plant_sequence_weight_from_mean_log_ratio(set_attr=setattr) -> None:
    """TRL #5814: a sequence's importance weight from the mean of its token log-ratios (a geometric mean of the
    ratios), not their sum (the product)."""
    weights = experience.rollout_correction_weights

    def mean_not_sum(old, behaviour, mask, *, mode, level, cap, low=None, cu_seqlens=None):
        num_tokens = mask.sum(-1, keepdim=True).clamp(min=1)
        return weights(old, old - (old - behaviour) / num_tokens, mask, mode=mode, level=level, cap=cap, low=low,
                       cu_seqlens=cu_seqlens)

    set_attr(experience, "rollout_correction_weights", mean_not_sum)
