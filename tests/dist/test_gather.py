"""Generation with gathered weights (fsdptrain/generation/gather.py) on 2 gloo ranks: the same tokens as FSDP2's
per-forward all-gathers, greedy and seeded sampling, fp32 and bf16, with a constant number of all-gathers instead of
one per layer per decoded token."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch
from tests.dist.workers.gather_checks import VARIANTS

UNITS = 3  # the tiny policy: 2 decoder layers + the root


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    result = launch("gather_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("gather"))
    return result.checked(2, error_free=True).results


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_same_tokens(two_ranks, variant, sampling):
    for rank in (0, 1):
        results = two_ranks[rank]["results"]
        per_token = results[f"{variant}/{sampling}/per_token"]
        gathered = results[f"{variant}/{sampling}/gathered"]
        assert gathered["tokens"] == per_token["tokens"]
        assert any(len(t) > 4 for t in gathered["tokens"])  # something was generated


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gathered_once(two_ranks, variant):
    for rank in (0, 1):
        results = two_ranks[rank]["results"]
        gathered, per_token = results[f"{variant}/greedy/gathered"], results[f"{variant}/greedy/per_token"]
        # At most once per unit (the root may still be unsharded from an earlier forward: it never reshards after
        # one), whatever the number of decoded tokens; without gathering, each of the 2 layers in each of 8 forwards.
        assert 2 <= gathered["all_gathers"] <= UNITS
        assert per_token["all_gathers"] >= 8 * 2
        assert gathered["unsharded_inside"] and not per_token["unsharded_inside"]
        assert gathered["sharded_after"] and per_token["sharded_after"]


def test_the_trainers_rollouts_honour_gather_weights(two_ranks):
    """rollout.gather_weights reaches the training loop's generation (PromptSource.rollouts): the same tokens, one
    all-gather per unit with `always` instead of one per layer per decoded token with `never`."""
    for rank in (0, 1):
        results = two_ranks[rank]["results"]
        never, always = results["trainer/never"], results["trainer/always"]
        assert always["tokens"] == never["tokens"]
        assert always["all_gathers"] <= UNITS
        assert never["all_gathers"] >= 6 * 2
