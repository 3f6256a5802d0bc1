"""Ranks whose metric names differ are refused before their buffers are reduced by position."""

from __future__ import annotations

from tests.dist.launch import launch


def test_a_rank_with_one_metric_more_is_an_error_naming_it(tmp_path):
    result = launch("schema_mismatch.py", nproc=2, out_dir=tmp_path, timeout_s=120)
    result.checked(2)
    for rank in (0, 1):
        record = result.results[rank]
        assert record["same_sum"] == 6.0  # agreeing ranks reduce as before: 3 + 3
        assert record["error"] is not None and "actor/extra differ" in record["error"], record
        assert "reward/mean" not in record["error"] and "batch/num_seqs" not in record["error"]
