"""Reward metrics of one rank's scored samples, as typed :mod:`fsdptrain.metrics.typed` metrics that reduce exactly.

Every metric is built from additive statistics, so merging micro-batches and the trainer's rank reduction
(``flatten`` / ``all_reduce`` / ``unflatten``) give the numbers one process would compute over the whole step:

- ``reward/<function>/mean`` (MEAN): the function's mean over the samples it applied to (None left out);
  timed-out samples count with ``timeout_score``. Absent when it applied to none.
- ``reward/<function>/num_timed_out`` (SUM): samples scored ``timeout_score`` because the call timed out.
- ``reward/mean`` (MEAN): the weighted total's mean over all samples.
- ``reward/std`` (DERIVED over [sum, sum of squares, count]): the population std of the total over the whole step.
  The moments are summed over ranks, so this is the global std, not a mean of per-rank stds.
- ``reward/all_equal_group_share`` (MEAN over prompt groups): the share of groups whose samples' totals are all
  exactly equal (no learning signal for group baselines). Exact across ranks because a group never spans ranks.
- ``reward/num_no_reward`` (SUM): samples to which no function applied (their total is 0.0).
"""

from __future__ import annotations

from typing import Sequence

from fsdptrain.rewards.runner import RewardScores
from fsdptrain.metrics.typed import Derived, Mean, Metrics, Sum, std_from_moments


def reward_metrics(scores: RewardScores, *, groups: Sequence[int]) -> Metrics:
    """The metrics above for samples whose prompt groups are ``groups`` (one entry per sample, as scored)."""
    total = scores.total
    assert len(groups) == len(total), "one group index per scored sample"
    out = {}
    for name, values in scores.raw.items():
        applied = [v for v in values if v is not None]
        out[f"reward/{name}/mean"] = Mean(sum(applied), len(applied))
        out[f"reward/{name}/num_timed_out"] = Sum(scores.num_timed_out[name])
    out["reward/mean"] = Mean(sum(total), len(total))
    out["reward/std"] = Derived([sum(total), sum(t * t for t in total), len(total)], std_from_moments)
    by_group: dict[int, list[float]] = {}
    for g, t in zip(groups, total):
        by_group.setdefault(g, []).append(t)
    num_equal = sum(1 for values in by_group.values() if min(values) == max(values))
    out["reward/all_equal_group_share"] = Mean(num_equal, len(by_group))
    out["reward/num_no_reward"] = Sum(scores.num_no_reward)
    return Metrics(out)
