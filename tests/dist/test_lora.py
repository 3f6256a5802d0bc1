"""LoRA on 2 gloo ranks (tests/dist/workers/lora_checks.py): the adapters' step equals the single-process peft model
in every agg mode (also with activation checkpointing and on HSDP), the reference is the policy without adapters (no
second copy), export and generation reproduce the trained model, checkpoints hold the adapters and resume exactly."""

from __future__ import annotations

import pytest

from fsdptrain.registry.names import AGG_MODES
from tests.dist.launch import launch

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    result = launch("lora_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("lora"), timeout_s=900)
    result.checked(2, error_free=True)
    return [result.results[rank]["results"] for rank in (0, 1)]


STEPS = [f"plain/policy/{mode}" for mode in AGG_MODES] + [
    "plain/value/seq-mean-token-mean", "checkpointing/policy/token-mean", "hsdp/policy/seq-mean-token-sum-norm",
    "bf16/policy/token-mean"]
# fp32: the same arithmetic up to summation order (measured <= 1.4e-6); a skipped step gives update_rel 1.0. bf16
# params against the fp32 reference: the bounds of tests/dist/test_train_step.py's bf16 variant.
GRAD_TOLERANCE, UPDATE_TOLERANCE = {"bf16": 2e-2}, {"bf16": 0.1}


@pytest.mark.parametrize("key", STEPS)
def test_adapter_step_matches_the_unsharded_peft_model(ranks, key):
    variant = key.split("/")[0]
    for results in ranks:
        r = results[key]
        assert r["grad_rel"] <= GRAD_TOLERANCE.get(variant, 1e-5), r
        assert r["update_rel"] <= UPDATE_TOLERANCE.get(variant, 1e-5), r
        # the frozen base weights are kept in the param dtype, the adapters in fp32 (master weights)
        assert r["frozen_dtypes"] == ["torch.bfloat16" if variant == "bf16" else "torch.float32"]
        assert r["trainable_dtypes"] == ["torch.float32"]
        head = {"score.weight", "score.bias"} if "/value/" in key else set()
        assert all("lora_" in name for name in set(r["grad_names"]) - head), r["grad_names"]
        assert head <= set(r["grad_names"])
        assert any(".lora_A." in name for name in r["grad_names"])  # lora_B off zero: A has a gradient too
        assert r["frozen_grads"] == 0 and r["frozen_changed"] == 0
        assert r["optimizer_params"] == r["trainable_params"] and r["optimizer_numel"] == r["trainable_numel"]


def test_reference_is_the_policy_without_adapters(ranks):
    for results in ranks:
        m = results["model"]
        assert m["adapters_matter"] > 1e-3
        assert m["disabled_vs_base"] <= 1e-6
        assert m["enabled_again_vs_before"] == 0.0
        assert all(m["trainable_after_disable"]) and len(m["trainable_after_disable"]) == m["num_adapter_tensors"]
        assert m["adapter_grads_after_disable"] == m["num_adapter_tensors"]


def test_kl_loss_allocates_no_reference_copy(ranks):
    for results in ranks:
        b = results["build_models"]
        assert b["lora/reference_is_policy"] and b["lora/unique_params"] == b["lora/policy_params"]
        assert not b["full/reference_is_policy"] and b["full/unique_params"] == 2 * b["full/policy_params"]


def test_export_reproduces_the_trained_logits(ranks):
    m = ranks[0]["model"]
    assert m["export_adapter_class"].startswith("PeftModel")
    assert m["export_adapter_vs_trained"] <= 1e-5
    assert m["export_merged_vs_trained"] <= 1e-5


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("gather", [False, True])
def test_generation_gives_the_unsharded_peft_tokens(ranks, sampled, gather):
    for results in ranks:
        assert results["model"][f"tokens_equal/sampled={sampled}/gather={gather}"]
        assert results["model"][f"num_tokens/sampled={sampled}"] > 8


def test_checkpoint_holds_the_adapters_and_resumes_exactly(ranks):
    for results in ranks:
        m = results["model"]
        assert m["checkpoint_restored_equal"] and m["checkpoint_next_step_equal"]
        # the adapters and their two AdamW moments, no base weight (a tied head included); full: every weight
        assert m["checkpoint_elements_lora"] == {  # AdamW: two moments per element, one step count per tensor
            "models": m["trainable_numel"], "optimizers": 2 * m["trainable_numel"] + m["num_adapter_tensors"]}
        assert m["checkpoint_elements_full"]["models"] >= m["full_numel"]
        assert m["trainable_numel"] < 0.1 * m["all_numel"]
