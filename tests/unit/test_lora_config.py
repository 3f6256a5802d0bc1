"""LoRA's config (docs/lora.md): the fields' ranges, the target modules, the combinations refused with one line, a
missing peft; and the pieces the adapters rest on (fsdptrain/model/lora.py, store_frozen_in, the checkpoint's
frozen names)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.model.loading import TINY_CONFIG, build_full_model, meta_model, resolve_config, trainable_parameters
from fsdptrain.model.lora import PEFT_MISSING, LoraSettings, linear_module_names, resolve_target_modules
from fsdptrain.preflight import check_lora_targets

pytest.importorskip("peft")

LLAMA_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("overrides, message", [
    (["model.lora.r=-1"], "model.lora.r=-1 must be >= 0"),
    (["model.lora.alpha=0"], "model.lora.alpha=0.0 must be a finite number > 0"),
    (["model.lora.dropout=1.0"], "model.lora.dropout=1.0 must be a number in [0, 1)"),
    (["model.lora.dropout=-0.1"], "model.lora.dropout=-0.1 must be a number in [0, 1)"),
    (["model.lora.r=8", "model.lora.target_modules=attention"],
     "model.lora.target_modules='attention' must be all-linear or a list"),
    (["model.lora.r=8", "model.lora.target_modules=[]"], "must be all-linear or a non-empty list"),
    (["model.lora.r=8", "drafter.enabled=true"],
     "model.lora.r=8 with drafter.enabled=true is not supported"),
    (["model.lora.r=8", "parallel.cpu_offload=true"],
     "model.lora.r=8 with parallel.cpu_offload=true is not supported"),
    (["model.lora.r=8", "parallel.compile=true"], "model.lora.r=8 with parallel.compile=true is not supported"),
    (["model.lora.critic=true"], "model.lora.critic=true gives the critic adapters of rank model.lora.r, which is 0"),
    (["model.lora.r=8", "model.lora.critic=true", "algorithm=grpo"], "there is no critic to adapt"),
])
def test_bad_lora_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_good_lora_settings_compose():
    cfg = compose_config(["model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0.05",
                          "model.lora.target_modules=[q_proj,v_proj]", "model.lora.critic=true"])
    assert cfg.model.lora.r == 8 and list(cfg.model.lora.target_modules) == ["q_proj", "v_proj"]
    assert compose_config([]).model.lora.r == 0  # off by default


def test_target_modules_matching_nothing_name_the_linear_modules():
    cfg = compose_config(["model.lora.r=8", "model.lora.target_modules=[q_proj,qkv,fc1]"])
    with pytest.raises(ConfigError) as err:
        check_lora_targets(cfg)
    assert str(err.value) == ("model.lora.target_modules: 'qkv', 'fc1' match no linear module of LlamaForCausalLM; "
                              f"its linear modules are: {', '.join(LLAMA_LINEAR)}")
    check_lora_targets(compose_config(["model.lora.r=8"]))  # all-linear: fine


def test_missing_peft_is_one_line_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        check_lora_targets(compose_config(["model.lora.r=8"]))
    assert str(err.value) == PEFT_MISSING and "pip install 'fsdptrain[lora]'" in PEFT_MISSING


def test_all_linear_is_the_decoder_layers_linear_modules_never_a_head():
    value = meta_model("value", resolve_config(path=None, config=TINY_CONFIG))
    assert linear_module_names(value) == LLAMA_LINEAR  # not score, not lm_head
    assert resolve_target_modules(value, ("v_proj", "q_proj")) == ["v_proj", "q_proj"]


def test_only_adapters_train_and_the_value_head_too():
    settings = LoraSettings(r=2, alpha=4.0, dropout=0.0, target_modules=("q_proj",))
    policy = build_full_model("policy", path=None, config=TINY_CONFIG, seed=0, lora=settings)
    names = {n for n, p in policy.named_parameters() if p.requires_grad}
    # 2 layers x q_proj x (A, B): r x hidden and hidden x r
    assert names == {f"model.layers.{i}.self_attn.q_proj.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"}
    assert sum(p.numel() for p in trainable_parameters(policy)) == 2 * (2 * 64 + 64 * 2)
    value = build_full_model("value", path=None, config=TINY_CONFIG, seed=0,
                             lora=LoraSettings(r=2, alpha=4.0, dropout=0.0, trainable_head=True))
    assert {"score.weight", "score.bias"} <= {n for n, p in value.named_parameters() if p.requires_grad}
    # lora_B starts at zero: fresh adapters compute the base model's logits exactly
    base = build_full_model("policy", path=None, config=TINY_CONFIG, seed=0)
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(policy(input_ids=ids).logits, base(input_ids=ids).logits)


def test_frozen_weights_stored_in_the_param_dtype_stay_tied():
    from fsdptrain.distributed.sharded_checkpoint import _frozen_names
    from fsdptrain.distributed.fsdp import store_frozen_in

    model = meta_model("policy", resolve_config(path=None, config=TINY_CONFIG),
                       lora=LoraSettings(r=2, alpha=4.0, dropout=0.0))
    store_frozen_in(model, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    frozen = _frozen_names(model)
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.base_layer.weight"} <= frozen
    assert not any("lora_" in name for name in frozen)
