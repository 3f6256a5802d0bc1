"""Reward metrics: hand-computed values, and two ranks' halves reduce to the whole step's numbers."""

import math

import torch

from fsdptrain.rewards.reward_metrics import reward_metrics
from fsdptrain.rewards.runner import RewardScores
from fsdptrain.metrics.buffers import Schema, flatten, unflatten
from fsdptrain.metrics.typed import Kind, finalize, merge

# 3 groups of 2: group 0 = (1, 1) all equal; group 1 = (0, 2); group 2 = (0.5, 0.5) all equal
RAW = {"acc": [1.0, 1.0, 0.0, 1.0, None, None], "fmt": [0.0, 0.0, 0.0, 1.0, 0.5, 0.5]}
TOTAL = [1.0, 1.0, 0.0, 2.0, 0.5, 0.5]
GROUPS = [0, 0, 1, 1, 2, 2]
FMT_TIMED_OUT = [0, 0, 0, 0, 1, 1]  # group 2's fmt call timed out and scored timeout_score = 0.5


def scores(sl):
    return RewardScores(raw={k: v[sl] for k, v in RAW.items()}, total=TOTAL[sl],
                        num_timed_out={"acc": 0, "fmt": sum(FMT_TIMED_OUT[sl])},
                        num_no_reward=0)


def test_values_by_hand():
    m = reward_metrics(scores(slice(0, 6)), groups=GROUPS)
    mean = 5.0 / 6
    std = math.sqrt((1 + 1 + 0 + 4 + 0.25 + 0.25) / 6 - mean ** 2)
    got = finalize(m)
    assert got["reward/acc/mean"] == 3.0 / 4  # None left out: 4 samples applied
    assert got["reward/fmt/mean"] == 2.0 / 6
    assert got["reward/mean"] == mean
    assert abs(got["reward/std"] - std) < 1e-12
    assert got["reward/all_equal_group_share"] == 2.0 / 3
    assert got["reward/num_no_reward"] == 0.0
    assert got["reward/fmt/num_timed_out"] == 2.0
    assert m["reward/std"].kind is Kind.DERIVED and m["reward/mean"].kind is Kind.MEAN
    assert m["reward/all_equal_group_share"].kind is Kind.MEAN and m["reward/fmt/num_timed_out"].kind is Kind.SUM


def test_two_ranks_reduce_to_the_whole_step():
    whole = finalize(reward_metrics(scores(slice(0, 6)), groups=GROUPS))
    rank0 = reward_metrics(scores(slice(0, 2)), groups=GROUPS[0:2])
    rank1 = reward_metrics(scores(slice(2, 6)), groups=GROUPS[2:6])
    schema = Schema.of(rank0, rank1)
    b0, b1 = flatten(rank0, schema), flatten(rank1, schema)
    reduced = unflatten(type(b0)(b0.sum + b1.sum, torch.minimum(b0.min, b1.min), torch.maximum(b0.max, b1.max)),
                        schema)
    for got in (finalize(reduced), finalize(merge(rank0, rank1))):
        assert got.keys() == whole.keys()
        for key in whole:
            assert abs(got[key] - whole[key]) < 1e-12, key


def test_a_function_that_never_applied_has_no_mean():
    only_none = RewardScores(raw={"acc": [None, None]}, total=[0.0, 0.0], num_timed_out={"acc": 0}, num_no_reward=2)
    got = finalize(reward_metrics(only_none, groups=[0, 0]))
    assert "reward/acc/mean" not in got
    assert got["reward/num_no_reward"] == 2.0 and got["reward/all_equal_group_share"] == 1.0
