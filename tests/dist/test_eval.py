"""The sampled evaluation (docs/evaluation.md) on 2 gloo ranks: the same numbers as on one, torch's global RNG
untouched."""

from __future__ import annotations

from tests.dist.launch import launch


def test_sampled_eval_is_the_same_on_two_ranks_as_on_one(tmp_path):
    result = launch("eval_checks.py", nproc=2, out_dir=tmp_path)
    result.checked(2, error_free=True)
    for rank in (0, 1):
        found = result.results[rank]
        assert found["two_ranks"] == found["one_rank"]  # exactly: the samples do not depend on the split
        assert set(found["two_ranks"]) == {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4", "eval/maj@4"}
        assert found["rng_unchanged"]
    one = result.results[0]["one_rank"]
    # something was sampled and scored: at threshold 0.3 the untrained model gets a digit right now and then
    assert 0 < one["eval/pass@1"] <= one["eval/pass@2"] <= one["eval/pass@4"] <= 1
