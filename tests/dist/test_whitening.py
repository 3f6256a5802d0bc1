"""Whitened advantages on 2 ranks: global mean 0 and (unbiased) variance 1 over every valid token of the batch, and
equal to one process whitening the whole batch. A whitening over the local rank's tokens fails both."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch

ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("whitening")
    return launch("whitening_checks.py", nproc=2, out_dir=out, timeout_s=180).checked(2).results


@pytest.mark.parametrize("name", ESTIMATORS)
def test_two_ranks_whiten_with_the_global_moments(records, name):
    merged = {**records[0]["ranks"][name], **records[1]["ranks"][name]}
    assert sorted(merged, key=int) == [str(i) for i in range(9)] and len(records[0]["ranks"][name]) == 6
    tokens = [a for seq in merged.values() for a in seq]
    n = len(tokens)
    mean = sum(tokens) / n
    var = sum((a - mean) ** 2 for a in tokens) / (n - 1)
    assert abs(mean) < 1e-6 and abs(var - 1.0) < 1e-5, (mean, var)
    single = records[0]["single"][name]
    worst = max(abs(a - b) for i in single for a, b in zip(single[i], merged[i]))
    assert worst < 1e-5, worst
