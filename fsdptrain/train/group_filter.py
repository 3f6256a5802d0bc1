"""DAPO's dynamic sampling in the loop: keep only prompt groups with a reward signal, generating more rounds of
prompts until the step has enough of them.

The decision per group is `fsdptrain.rl.dynamic_sampling.groups_with_signal` (its scores alone). The kept groups
of every round and every rank are then ordered by (round, global group index within its round), the first
``target_groups`` are kept and renumbered 0, 1, ... in that order, and each rank takes the groups it owns under the
new numbering (``index % world_size``, docs/architecture.md). So which groups are trained, their mini-batch and
their owner do not depend on the world size, only on the rollouts. The source is reached through a callback, so
any source that can produce another round of rollouts plugs in.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.rl.dynamic_sampling import groups_with_signal
from fsdptrain.metrics.typed import Metrics, Sum, merge_all

MoreRollouts = Callable[[int], list[Rollout]]
"""``more(round)`` -> this rank's rollouts of extra round ``round`` (1, 2, ...), group indices global in the round."""


Kept = tuple[int, int, int, Rollout]
"""A kept rollout: (round, its group's global index within the round, its position in this rank's round, rollout)."""


def _kept(rollouts: list[Rollout], round_index: int) -> tuple[list[Kept], Metrics]:
    if not rollouts:
        keep = []
        metrics = groups_with_signal(torch.zeros(0), torch.zeros(0, dtype=torch.long))[2]
    else:
        scores = torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float64)
        groups = torch.tensor([int(r.group) for r in rollouts], dtype=torch.long)
        keep_N, _, metrics = groups_with_signal(scores, groups)
        keep = keep_N.tolist()
    return [(round_index, r.group, k, r) for k, (r, ok) in enumerate(zip(rollouts, keep)) if ok], metrics


def renumber(kept_per_rank: list[list[Kept]], *, target_groups: int, rank: int, world_size: int) -> list[Rollout]:
    """This rank's share of the first ``target_groups`` kept groups of every rank, renumbered.

    The groups are ordered by (round, global index within the round), numbered 0, 1, ... in that order, cut to
    ``target_groups``, and this rank takes group ``i`` iff ``i % world_size == rank``, each rollout with ``group=i``
    and in that order (within a group: the order its rank generated them). ``kept_per_rank`` is every rank's list of
    kept rollouts (the all-gather); the answer depends on their union only, not on which rank held what.
    """
    everyone = sorted((e for part in kept_per_rank for e in part), key=lambda e: e[:3])
    order: dict[tuple[int, int], int] = {}
    for round_, group, _, _ in everyone:
        order.setdefault((round_, group), len(order))
    mine = []
    for round_, group, _, rollout in everyone:
        index = order[(round_, group)]
        if index < target_groups and index % world_size == rank:
            mine.append(dataclasses.replace(rollout, group=index))
    return mine


def filter_groups(first: list[Rollout], more: MoreRollouts, *, target_groups: int, max_rounds: int, rank: int,
                  world_size: int) -> tuple[list[Rollout], Metrics]:
    """This rank's rollouts of the kept groups (renumbered) and the metrics (this rank's; the caller reduces them).

    Collective: one all-reduce per round and one all-gather of the kept rollouts. Metrics:
    ``dynamic_sampling/filtered_frac`` (MEAN over every group seen), ``dynamic_sampling/kept_groups`` (SUM, before
    the cut to ``target_groups``), ``dynamic_sampling/rounds`` (SUM over ranks / world: the rounds generated).
    """
    kept, seen = [], []
    rollouts, round_index = first, 0
    while True:
        entries, metrics = _kept(rollouts, round_index)
        kept += entries
        seen.append(metrics)
        local_groups = len({(e[0], e[1]) for e in kept})
        total = int(world.all_reduce_sum(torch.tensor([float(local_groups)], dtype=torch.float64))[0])
        round_index += 1
        if total >= target_groups or round_index >= max_rounds:
            break
        rollouts = more(round_index)
    mine = renumber(world.all_gather_object(kept), target_groups=target_groups, rank=rank, world_size=world_size)
    merged = Metrics((name.replace("dynamic_sampling_", "dynamic_sampling/"), metric)
                     for name, metric in merge_all(seen).items())
    rounds = Metrics({"dynamic_sampling/rounds": Sum(round_index / world_size)})
    return mine, merge_all([merged, rounds])
