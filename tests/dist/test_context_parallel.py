"""Context parallelism on 2 gloo ranks (tests/dist/workers/context_parallel_checks.py): one CP group of 2 holds the
whole mini-batch; packed rows with several sequences, some crossing the chunk boundaries, give the same log-probs,
entropy, metrics (the loss included) and gradients as the one-process fused loss, in every agg mode, with and
without activation checkpointing and LoRA."""

from __future__ import annotations

import pytest

from fsdptrain.registry.names import AGG_MODES
from tests.dist.launch import launch
from tests.dist.workers.train_step_checks import LOSS_SCALE_FACTOR

pytest.importorskip("peft")

VARIANTS = ("plain", "checkpointing", "lora")
KEYS = [f"{variant}/policy/{mode}" for variant in VARIANTS for mode in AGG_MODES] + [
    f"{variant}/value/{mode}" for variant in VARIANTS for mode in ("token-mean", "seq-mean-token-mean")] + [
    "bf16/policy/token-mean"]
# bf16 params against the fp32 reference: the bounds of tests/dist/test_lora.py's bf16 variant
GRAD_TOLERANCE, METRIC_TOLERANCE, LOGPROB_TOLERANCE = {"bf16": 2e-2}, {"bf16": 2e-2}, {"bf16": 5e-2}


def _loss_scale(key: str, r: dict) -> float:
    """token-sum's loss is N / loss_scale_factor times the token-mean loss of the same tokens, and its fp32 rounding
    (N terms, each moved by up to one ulp of its log-prob) grows alike: its bound is the token-mean bound scaled by
    N / loss_scale_factor (49 / 6 here; measured <= 1.1e-6, every other mode <= 1.6e-7)."""
    return r["ref_counts"][0] / LOSS_SCALE_FACTOR if key.endswith("/token-sum") else 1.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    result = launch("context_parallel_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("cp"), timeout_s=600)
    result.checked(2, error_free=True)
    return [result.results[rank]["results"] for rank in (0, 1)]


@pytest.mark.parametrize("key", KEYS)
def test_cp2_equals_one_process(ranks, key):
    variant = key.split("/")[0]
    for results in ranks:
        r = results[key]
        # fp32, the same arithmetic up to summation order and the log-sum-exp merge of a piece's two attention
        # parts: gradients measured <= 3.9e-7 relative, log-probs <= 4.8e-7 (one ulp at |log-prob| ~ 6)
        assert r["grad_abs"] <= GRAD_TOLERANCE.get(variant, 1e-6) * r["grad_scale"], r
        metric_bound = METRIC_TOLERANCE.get(variant, 1e-6) * _loss_scale(key, r)
        assert r["metric_names_equal"] and r["metric_rel"] <= metric_bound, r
        # each token counted once: the CP group's 2 ranks do not double the counts; the factor is dp x cp = 2
        assert r["norms"] == [*r["ref_counts"], 2], r
        if "logprob_abs" in r:
            assert r["logprob_abs"] <= LOGPROB_TOLERANCE.get(variant, 1e-6), r
            assert r["crossing_pieces"] >= 2, r  # sequences that cross a chunk boundary are exercised
