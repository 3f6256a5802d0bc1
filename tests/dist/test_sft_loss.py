"""The SFT loss on 2 gloo ranks equals transformers' own per-token cross-entropy (masked to the assistant's tokens,
token-mean over the global batch) on one process, within 1e-6 in fp32, in the loss and every gradient: the chats
split evenly or 3 and 1 over the ranks, each rank's share in one micro-batch, one per chat, one per chat in reverse
order, or the product's agreed plan (2 packs on each rank, one of them empty on the rank with 1 chat), with tied and
untied heads (tests/dist/workers/sft_loss_checks.py; docs/sft.md "Normalisation")."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    result = launch("sft_loss_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("sft_loss"), timeout_s=300)
    return result.checked(2).results


@pytest.mark.parametrize("tied", ["untied", "tied"])
@pytest.mark.parametrize("share, split", [("even", "one"), ("even", "each"), ("even", "reversed"),
                                          ("uneven", "one"), ("uneven", "agreed")])
def test_two_ranks_equal_transformers_cross_entropy_on_one_process(records, tied, share, split):
    for rank in (0, 1):
        assert records[rank]["error"] is None, records[rank]["error"]
        got = records[rank]["results"][f"{tied}/{share}/{split}"]
        assert got["names_match"], got
        assert abs(got["loss"] - got["reference_loss"]) <= 1e-6, got
        assert got["grad_max_diff"] <= 1e-6, got
    first, second = (records[rank]["results"][f"{tied}/{share}/{split}"] for rank in (0, 1))
    assert first["loss"] == second["loss"]
    assert first["micro_batches_all_ranks"] == {"one": 2, "each": 4, "reversed": 4, "agreed": 4}[split], first
