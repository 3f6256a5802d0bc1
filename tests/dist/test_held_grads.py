"""check-metrics compares gradients as each rank holds them (fsdptrain/check/layouts.py, ``held_grads``): its norm,
largest entry and largest difference, computed shard by shard and reduced over the ranks, equal the same numbers
from the gathered whole gradients, for an unevenly sharded FSDP model and an HSDP one (each shard on two ranks,
counted once), and a NaN on one rank makes them NaN on every rank (2 gloo ranks)."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    result = launch("held_grads_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("held_grads"), timeout_s=300)
    return result.checked(2).results


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_statistics_of_the_held_shards_equal_the_gathered_ones(records, mesh):
    for rank in (0, 1):
        record = records[rank]
        for stat in ("norm", "max_abs", "max_diff"):
            assert record[f"{mesh}/{stat}/relative_error"] < 1e-13, (rank, stat, record)
        assert record[f"{mesh}/nan_max_diff_is_nan"] and record[f"{mesh}/nan_norm_is_nan"], record
    assert records[0]["fsdp/sharded"]  # the FSDP case holds shards, not whole tensors


def test_hsdp_shards_are_whole_on_each_rank(records):
    """Each rank holds every entry once more: counted once, the norm above matches only with the copies divided out."""
    assert not records[0]["hsdp/sharded"]
