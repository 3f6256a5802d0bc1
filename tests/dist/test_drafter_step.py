"""The co-trained drafter on 2 gloo ranks (FSDP2) == one process, in every agg mode; the policy's gradients and
updated weights with the drafter on are bit-identical to those with it off; a refresh pass after the policy's step
(`refresh_drafter`) has the one-process gradient of the oracle taught by the updated policy."""

from __future__ import annotations

import pytest

from fsdptrain.registry.names import AGG_MODES
from tests.dist.launch import launch

# fp32; the drafter's gradients go through the chunked soft CE on one side and a plain softmax on the other
GRAD_TOLERANCE = 1e-5
# one clipped AdamW step (clip active), ||update - reference update|| / ||reference update||: a skipped step gives
# exactly 1.0, an unclipped one (the norm is several times the clip) far more than this
UPDATE_TOLERANCE = 1e-4
KEYS = [f"{mode}/response" for mode in AGG_MODES] + ["token-mean/all"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter_step")
    return launch("drafter_checks.py", nproc=2, out_dir=out, timeout_s=900).checked(2, error_free=True).results


@pytest.mark.parametrize("key", KEYS)
def test_drafter_gradients_and_update_match_one_process(results, key):
    for rank in (0, 1):
        r = results[rank]["results"][key]
        assert r["draft_norms"] == r["reference_counts"], r  # the folded all-reduce gives the hand-worked counts
        assert r["drafter_grad_rel"] <= GRAD_TOLERANCE, r
        assert r["drafter_update_rel"] <= UPDATE_TOLERANCE, r
        assert r["drafter_grad_norm"] > 0.05, r  # the clip was active


@pytest.mark.parametrize("key", KEYS)
def test_refresh_pass_matches_one_process_with_the_updated_policy_as_teacher(results, key):
    for rank in (0, 1):
        r = results[rank]["results"][key]
        assert r["refresh_grad_rel"] <= GRAD_TOLERANCE, r
        assert r["refresh_left_policy"] is True, r
        assert r["refresh_resharded_policy"] is True, r


@pytest.mark.parametrize("key", KEYS)
def test_policy_gradients_bit_identical_with_drafter_on_and_off(results, key):
    for rank in (0, 1):
        r = results[rank]["results"][key]
        assert r["num_policy_grads"] > 0
        assert r["policy_grads_identical"] is True, r
        assert r["policy_weights_identical"] is True, r
    assert (results[0]["results"][key]["num_local_seqs"], results[1]["results"][key]["num_local_seqs"]) == (4, 3)
