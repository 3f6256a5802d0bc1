"""Mixture-of-experts models through the real CLI (docs/moe.md): a tiny Qwen3-MoE folder whose config asks for
transformers' router loss (``output_router_logits: true``) trains with GRPO and SFT, the same on 1 and 2 ranks,
resumes exactly and exports a folder transformers loads; Mixtral (PPO, with its critic) and OLMoE train a step;
what is refused is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.e2e.test_multi_turn import assert_close_rows, assert_resumed_and_two_ranks_match, rows
from tests.helpers.tiny_moe import write_tiny_moe

GRPO = ("model=local", "algorithm=grpo", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
        "trainer.eval_every=0", "logging.progress=false", "trainer.lr_schedule=constant")
MOE_KEYS = {"moe/aux_loss", "moe/layer_0/load_max_share", "moe/layer_0/load_min_share", "moe/layer_1/load_cv"}


def test_qwen3_moe_grpo_trains_resumes_exactly_matches_on_two_ranks_and_exports(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    folder = write_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    args = (*GRPO, f"model.path={folder}", "trainer.steps=3", "checkpoint.every=2")
    one = run_cli("train", *args, "trainer.run_name=one", cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    assert ("mixture of experts: 2 MoE layers of 4 experts, top-2; load-balancing loss x 0.001 (the model's "
            "router_aux_loss_coef)") in one.stdout
    reference = rows(tmp_path / "runs" / "one")
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert all(MOE_KEYS <= set(r) and r["moe/aux_loss"] > 0 for r in reference)
    assert all(0 < r["moe/layer_0/load_min_share"] <= 0.25 <= r["moe/layer_0/load_max_share"] < 1 for r in reference)
    assert_resumed_and_two_ranks_match(tmp_path, args, reference)
    export = tmp_path / "runs" / "one" / "export" / "policy"
    assert json.loads((export / "config.json").read_text())["output_router_logits"] is True  # the user's, kept
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    moved = [n for n, t in source.state_dict().items() if not torch.equal(exported.state_dict()[n], t)]
    assert any("mlp.gate" in n for n in moved) and any("mlp.experts" in n for n in moved)


def test_qwen3_moe_sft_is_the_same_on_one_and_two_ranks_and_passes_check_metrics(tmp_path):
    from tests.helpers.chatml_tokenizer import chatml_tokenizer

    folder = write_tiny_moe(tmp_path / "model", "qwen3_moe", tokenizer=chatml_tokenizer())
    chats = [{"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
             for a in range(3) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    args = ("sft", f"model.path={folder}", f"data.path={tmp_path / 'train.jsonl'}", "sft.rows_per_step=4",
            "trainer.steps=2", "trainer.token_budget=64", "trainer.eval_every=0", "logging.progress=false")
    runs = {}
    for nproc in (1, 2):
        done = run_cli(*args[:1], "--nproc", str(nproc), *args[1:], f"trainer.run_name=sft{nproc}", cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[nproc] = rows(tmp_path / "runs" / f"sft{nproc}")
    assert all(MOE_KEYS <= set(r) for r in runs[1])
    assert_close_rows(runs[2], runs[1], tol=1e-5)
    check = run_cli("check-metrics", "data=sft", *args[1:4], "trainer.token_budget=64", "--json",
                    str(tmp_path / "check.json"), cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    packed = json.loads((tmp_path / "check.json").read_text())["layouts"]["micro-batches=2"]
    assert all(packed[m]["pass"] for m in ("sft/moe/aux_loss", "sft/moe/layer_1/load_cv", "sft/grad_max_diff"))


@pytest.mark.parametrize("arch, algorithm", [("mixtral", "ppo"), ("olmoe", "grpo")])
def test_mixtral_with_a_critic_and_olmoe_train_a_step(tmp_path, arch, algorithm):
    folder = write_tiny_moe(tmp_path / arch, arch)
    done = run_cli("train", *GRPO, f"algorithm={algorithm}", f"model.path={folder}", "trainer.steps=1",
                   "trainer.run_name=r", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    last = rows(tmp_path / "runs" / "r")[-1]
    assert MOE_KEYS <= set(last) and math.isfinite(last["moe/aux_loss"]) and last["actor/grad_norm"] > 0
    assert ("critic/grad_norm" in last) == (algorithm == "ppo")


def test_an_moe_model_without_a_value_class_refuses_a_critic_in_one_line(tmp_path):
    folder = write_tiny_moe(tmp_path / "olmoe", "olmoe")
    done = run_cli("train", "model=local", f"model.path={folder}", "algorithm=ppo", cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "olmoe, for which transformers has no value-model (token-classification) class" in lines[0]
    assert not Path(tmp_path / "runs").exists()


def test_lora_on_an_moe_policy_trains_the_attention_adapters_and_leaves_routers_and_experts_as_they_were(tmp_path):
    """docs/moe.md "What is supported": `all-linear` reaches the attention projections only; the merged export
    differs from the base there and nowhere in the routers or the stacked experts."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = write_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    done = run_cli("train", *GRPO, f"model.path={folder}", "model.lora.r=4", "trainer.lr=0.05", "trainer.steps=1",
                   "trainer.run_name=lora", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    adapter = load_file(tmp_path / "runs" / "lora" / "export" / "policy_adapter" / "adapter_model.safetensors")
    assert adapter and all(any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in adapter)
    base = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "lora" / "export" / "policy").state_dict()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for k in changed)
    assert not any(".mlp." in k for k in changed)  # routers (mlp.gate) and experts untouched
