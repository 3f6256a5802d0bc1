"""Context parallelism on 2 gloo ranks (tests/dist/workers/context_parallel_checks.py): one CP group of 2 holds the
whole mini-batch; packed rows with several sequences, some crossing the chunk boundaries, give the same log-probs,
entropy, metrics (the loss included) and gradients as the one-process fused loss, in every agg mode, with and
without activation checkpointing and LoRA."""

from __future__ import annotations

import pytest

from fsdptrain.registry.names import AGG_MODES
from tests.dist.launch import launch

pytest.importorskip("peft")

VARIANTS = ("plain", "checkpointing", "lora")
KEYS = [f"{variant}/policy/{mode}" for variant in VARIANTS for mode in AGG_MODES] + [
    f"{variant}/value/{mode}" for variant in VARIANTS for mode in ("token-mean", "seq-mean-token-mean")] + [
    "bf16/policy/token-mean"]
# bf16 params against the fp32 reference: the bounds of tests/dist/test_lora.py's bf16 variant
GRAD_TOLERANCE, METRIC_TOLERANCE, LOGPROB_TOLERANCE = {"bf16": 2e-2}, {"bf16": 2e-2}, {"bf16": 5e-2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    result = launch("context_parallel_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("cp"), timeout_s=600)
    assert result.returncode == 0, result.describe()
    for rank in (0, 1):
        assert result.results[rank]["error"] is None, result.results[rank]["error"]
    return [result.results[rank]["results"] for rank in (0, 1)]


@pytest.mark.parametrize("key", KEYS)
def test_cp2_equals_one_process(ranks, key):
    variant = key.split("/")[0]
    for results in ranks:
        r = results[key]
        # fp32, the same arithmetic up to summation order: measured <= 5.1e-7 relative
        assert r["grad_abs"] <= GRAD_TOLERANCE.get(variant, 1e-6) * r["grad_scale"], r
        assert r["metric_names_equal"] and r["metric_rel"] <= METRIC_TOLERANCE.get(variant, 1e-6), r
        # each token counted once: the CP group's 2 ranks do not double the counts; the factor is dp x cp = 2
        assert r["norms"] == [*r["ref_counts"], 2], r
        if "logprob_abs" in r:
            assert r["logprob_abs"] <= LOGPROB_TOLERANCE.get(variant, 1e-6), r
            assert r["crossing_pieces"] >= 2, r  # sequences that cross a chunk boundary are exercised
