"""Dynamic sampling's refill and renumbering (fsdptrain/train/group_filter.py) in one process, worked out by hand.

The scenario (shared with tests/dist/test_group_filter.py): every round has 4 prompt groups of 2 samples, group g
owned by rank g % world_size; a group has a signal iff its two rewards differ. Round 0 keeps groups 1 and 3, round 1
keeps 0 and 2, round 2 would keep 1. With target_groups=3 the loop stops after round 1 (4 kept >= 3) and the first
three in (round, group) order become 0 = (0, 1), 1 = (0, 3), 2 = (1, 0); (1, 2) is cut.
"""

from __future__ import annotations

import pytest

from fsdptrain.data.rollout_record import Rollout
from fsdptrain.metrics.typed import finalize
from fsdptrain.train.group_filter import filter_groups, renumber

SIGNAL = {0: {1, 3}, 1: {0, 2}, 2: {1}}
"""round -> the groups whose two samples score differently."""
GROUPS_PER_ROUND = 4


def round_rollouts(round_index: int, *, rank: int = 0, world_size: int = 1) -> list[Rollout]:
    """This rank's rollouts of ``round_index``; prompt_ids = [round, group, sample] names each one."""
    out = []
    for group in range(GROUPS_PER_ROUND):
        if group % world_size != rank:
            continue
        for sample in range(2):
            reward = float(sample) if group in SIGNAL[round_index] else 0.5
            out.append(Rollout(prompt_ids=[round_index, group, sample], response_ids=[7], reward=reward, group=group))
    return out


def run(*, target_groups: int, max_rounds: int, rank: int = 0, world_size: int = 1):
    asked = []

    def more(round_index: int) -> list[Rollout]:
        asked.append(round_index)
        return round_rollouts(round_index, rank=rank, world_size=world_size)

    mine, metrics = filter_groups(round_rollouts(0, rank=rank, world_size=world_size), more,
                                  target_groups=target_groups, max_rounds=max_rounds, rank=rank, world_size=world_size)
    return mine, finalize(metrics), asked


def test_refill_stops_once_enough_groups_are_kept_and_renumbers_them_in_round_order():
    mine, metrics, asked = run(target_groups=3, max_rounds=3)
    assert asked == [1]
    assert [(r.prompt_ids, r.group) for r in mine] == [
        ([0, 1, 0], 0), ([0, 1, 1], 0), ([0, 3, 0], 1), ([0, 3, 1], 1), ([1, 0, 0], 2), ([1, 0, 1], 2)]
    # 8 groups seen, 4 without a signal; 4 kept before the cut to 3; 2 rounds generated
    assert metrics == {"dynamic_sampling/filtered_frac": 0.5, "dynamic_sampling/kept_groups": 4.0,
                       "dynamic_sampling/rounds": 2.0}


def test_refill_stops_at_max_rounds_with_fewer_groups():
    mine, metrics, asked = run(target_groups=8, max_rounds=2)
    assert asked == [1]
    assert [r.group for r in mine] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.prompt_ids[:2] for r in mine[::2]] == [[0, 1], [0, 3], [1, 0], [1, 2]]
    assert metrics["dynamic_sampling/rounds"] == 2.0


def test_no_refill_when_the_first_round_has_enough():
    mine, metrics, asked = run(target_groups=2, max_rounds=3)
    assert asked == [] and [r.group for r in mine] == [0, 0, 1, 1] and metrics["dynamic_sampling/rounds"] == 1.0


def _kept(round_index: int, group: int, position: int) -> tuple[int, int, int, Rollout]:
    return (round_index, group, position,
            Rollout(prompt_ids=[round_index, group, position], response_ids=[7], reward=0.0, group=group))


# What an all-gather of 2 ranks returns: rank 0 kept (1, 0) and (1, 2), rank 1 kept (0, 1), (0, 3) and (1, 1), each
# group of two samples, listed out of order.
KEPT_PER_RANK = [
    [_kept(1, 2, 2), _kept(1, 2, 3), _kept(1, 0, 0), _kept(1, 0, 1)],
    [_kept(0, 3, 2), _kept(0, 1, 0), _kept(1, 1, 0), _kept(0, 1, 1), _kept(0, 3, 3), _kept(1, 1, 1)],
]


@pytest.mark.parametrize("rank, expected", [
    # new numbering: (0,1) -> 0, (0,3) -> 1, (1,0) -> 2, (1,1) -> 3, (1,2) -> 4 (cut at target_groups=4)
    (0, [([0, 1, 0], 0), ([0, 1, 1], 0), ([1, 0, 0], 2), ([1, 0, 1], 2)]),
    (1, [([0, 3, 2], 1), ([0, 3, 3], 1), ([1, 1, 0], 3), ([1, 1, 1], 3)]),
])
def test_renumber_orders_by_round_then_group_cuts_and_deals_round_robin(rank, expected):
    mine = renumber(KEPT_PER_RANK, target_groups=4, rank=rank, world_size=2)
    assert [(r.prompt_ids, r.group) for r in mine] == expected


def test_renumber_depends_on_the_union_not_on_which_rank_held_what():
    swapped = [KEPT_PER_RANK[1], KEPT_PER_RANK[0]]
    one_list = [KEPT_PER_RANK[0] + KEPT_PER_RANK[1]]
    for rank in (0, 1):
        expected = renumber(KEPT_PER_RANK, target_groups=4, rank=rank, world_size=2)
        assert renumber(swapped, target_groups=4, rank=rank, world_size=2) == expected
        assert renumber(one_list, target_groups=4, rank=rank, world_size=2) == expected
