"""DAPO's dynamic sampling: drop prompt groups whose responses all scored the same (they carry no group signal).

DAPO (Yu et al., arXiv 2503.14476) over-samples and keeps only groups with both better and worse responses, whose
group-relative advantages are not all 0. The decision for a group depends on that group's scores alone, and a group
never spans ranks, so each rank decides locally and the result does not depend on the world size or on the order
of sequences. Refilling the batch to its size (DAPO's extra generation rounds) is the loop's job.

Legend: `_N` one value per sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fsdptrain.metrics.typed import Mean, Metrics, Sum


def groups_with_signal(scores_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor, Metrics]:
    """(keep_N, kept_group_ids, metrics): keep sequence i iff the scores of its group are not all equal
    (max_g != min_g, exact comparison); `kept_group_ids` the kept groups' global indices, ascending.

    Metrics (exact summed over ranks, which hold disjoint groups):
        dynamic_sampling_filtered_frac (MEAN): groups dropped / groups seen (group-weighted);
        dynamic_sampling_kept_groups (SUM): groups kept.
    """
    if scores_N.dim() != 1 or group_ids_N.shape != scores_N.shape:
        raise ValueError(f"scores {tuple(scores_N.shape)} and group ids {tuple(group_ids_N.shape)} must both be [N]")
    unique_ids, inverse = torch.unique(group_ids_N, return_inverse=True)  # sorted: deterministic order
    num_groups = unique_ids.numel()
    hi = scores_N.new_zeros(num_groups).scatter_reduce(0, inverse, scores_N, "amax", include_self=False)
    lo = scores_N.new_zeros(num_groups).scatter_reduce(0, inverse, scores_N, "amin", include_self=False)
    keep_group = hi != lo
    metrics = Metrics({
        "dynamic_sampling_filtered_frac": Mean((~keep_group).sum(), num_groups),
        "dynamic_sampling_kept_groups": Sum(keep_group.sum()),
    })
    return keep_group[inverse], unique_ids[keep_group], metrics
