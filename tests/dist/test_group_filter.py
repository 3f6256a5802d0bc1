"""Dynamic sampling on 2 gloo ranks agrees with one process: the same groups are kept, renumbered alike and dealt
round-robin (group i on rank i % 2), the refill stops after the same round on every rank (the kept count is summed
over ranks, and here rank 0 keeps nothing in round 0), and the per-rank metrics sum to the one-process values. A
rank deciding on its own kept count, or renumbering its own groups only, fails these."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch
from tests.dist.workers.group_filter_checks import CASES
from tests.unit.test_group_filter import run


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("group_filter")
    return launch("group_filter_checks.py", nproc=2, out_dir=out, timeout_s=180).checked(2).results


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_keep_renumber_and_deal_as_one_process(records, case):
    single, single_metrics, single_asked = run(**CASES[case])
    ranks = [records[r][case] for r in (0, 1)]
    for rank, rec in enumerate(ranks):
        assert rec["asked"] == single_asked
        assert {group % 2 for _, group in rec["rollouts"]} <= {rank}
    merged = sorted((tuple(ids), group) for rec in ranks for ids, group in rec["rollouts"])
    assert merged == sorted((tuple(r.prompt_ids), r.group) for r in single)
    assert sum(rec["metrics"]["dynamic_sampling/kept_groups"] for rec in ranks) == single_metrics[
        "dynamic_sampling/kept_groups"]
    assert sum(rec["metrics"]["dynamic_sampling/rounds"] for rec in ranks) == single_metrics["dynamic_sampling/rounds"]


def test_a_rank_receives_groups_another_rank_generated(records):
    # (0, 1) was generated on rank 1 (1 % 2) and becomes group 0, owned by rank 0
    assert [[0, 1, 0], 0] in records[0]["refill"]["rollouts"]
