"""Reward models: folder validation, re-tokenisation, packed scoring against one sequence at a time, the sharded
build (a world of one) with offload, and the critic initialised from a reward model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForTokenClassification

from fsdptrain.config import ConfigError
from fsdptrain.data.packing import pack_sequences
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.distributed import world as fdist
from fsdptrain.distributed.fsdp_reward_models import (
    build_reward_model,
    build_value_model_from_reward_model,
    value_state_dict_from_reward_model,
)
from fsdptrain.model.attention_switch import packed_attention, set_attention
from fsdptrain.model.loading import TINY_CONFIG, config_for, resolve_config
from fsdptrain.model.reward_model import (
    load_full_reward_model,
    load_reward_model_spec,
    reward_input_ids,
    score_packed,
    score_sequences,
)
from tests.helpers.reward_model_folders import (
    CHAT_TEMPLATE,
    char_tokenizer,
    save_policy_shaped_reward_model,
    save_reward_model,
)

# token ids 4.. are the tokenizers' characters; no pad (0), so transformers' own pooling reads the last token
SEQUENCES = [[1, 7, 9, 11, 30], [1, 5, 6, 7, 8, 9, 10, 12, 40], [1, 22, 23], [1, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_models")
    return {
        "llama": save_reward_model(root / "llama", arch="llama", seed=1),
        "qwen2": save_reward_model(root / "qwen2", arch="qwen2", seed=2),
        "chat": save_reward_model(root / "chat", tokenizer=char_tokenizer(CHAT_TEMPLATE), seed=3),
        "policy_shaped": save_policy_shaped_reward_model(root / "policy_shaped", seed=4),
        "causal": save_reward_model(root / "causal", causal=True),
        "two_labels": save_reward_model(root / "two_labels", num_labels=2),
    }


# ---- validation ------------------------------------------------------------------------------------------------


def _variant(folders, tmp_path, name: str):
    """A broken copy of the good Llama folder (or another saved folder), and the words its error must hold."""
    good = tmp_path / "rm"
    if name == "missing":
        return tmp_path / "nowhere", "does not exist"
    if name == "a_file":
        good.write_text("not a folder")
        return good, "is not a folder"
    if name in ("causal", "two_labels"):
        return folders[name], {"causal": "is a causal LM (LlamaForCausalLM)", "two_labels": "num_labels=2"}[name]
    shutil.copytree(folders["llama"], good)
    if name == "no_config":
        (good / "config.json").unlink()
        return good, "has no config.json"
    if name == "corrupt_config":
        (good / "config.json").write_text("{ not json")
        return good, "cannot read config.json"
    if name == "token_classifier":
        config = json.loads((good / "config.json").read_text())
        config["architectures"] = ["LlamaForTokenClassification"]
        (good / "config.json").write_text(json.dumps(config))
        return good, "is not a sequence classifier (LlamaForTokenClassification)"
    if name == "no_architectures":
        config = json.loads((good / "config.json").read_text())
        del config["architectures"]
        (good / "config.json").write_text(json.dumps(config))
        return good, "names no architectures"
    if name == "no_tokenizer":
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (good / file).unlink()
        return good, "has no tokenizer files"
    if name == "no_weights":
        (good / "model.safetensors").unlink()
        return good, "has no weights"
    if name == "garbage_weights":
        (good / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
        return good, "unreadable weights in model.safetensors"
    if name == "truncated_weights":
        data = (good / "model.safetensors").read_bytes()
        (good / "model.safetensors").write_bytes(data[: len(data) // 2])
        return good, "unreadable weights in model.safetensors"
    if name == "causal_weights":
        shutil.copy(folders["causal"] / "model.safetensors", good / "model.safetensors")
        return good, "hold no score.weight"
    raise AssertionError(name)


BAD = ["missing", "a_file", "no_config", "corrupt_config", "causal", "token_classifier", "no_architectures",
       "two_labels", "no_tokenizer", "no_weights", "garbage_weights", "truncated_weights", "causal_weights"]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_folder_is_one_config_error_naming_it(folders, tmp_path, name):
    path, words = _variant(folders, tmp_path, name)
    with pytest.raises(ConfigError) as caught:
        load_reward_model_spec(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message and words in message, message


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_good_folder_loads_with_its_own_tokenizer(folders, arch):
    spec = load_reward_model_spec(folders[arch])
    want = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification"}[arch]
    assert spec.architecture == want
    assert spec.config.num_labels == 1 and not spec.uses_chat_template
    assert spec.tokenizer.get_vocab() != load_bundled_tokenizer().get_vocab()


# ---- re-tokenisation -------------------------------------------------------------------------------------------


def test_plain_concatenation_without_a_chat_template(folders):
    spec = load_reward_model_spec(folders["llama"])
    # bos 1; characters from 4 in CHARS order: a=4, b=5, ' '=40, c=6
    assert reward_input_ids(spec, "ab", " c") == [1, 4, 5, 40, 6]


def test_the_chat_template_is_applied(folders):
    spec = load_reward_model_spec(folders["chat"])
    assert spec.uses_chat_template
    # "<u>ab<a>c": the role tokens 47 and 48 (after the 47 base tokens), no BOS (the template writes none)
    assert reward_input_ids(spec, "ab", "c") == [47, 4, 5, 48, 6]


# ---- packed scoring --------------------------------------------------------------------------------------------


def _alone(model, ids: list[int]) -> float:
    """transformers' own forward and pooling on one unpadded sequence (sdpa)."""
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _per_token_scores(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state
        return model.score(hidden)[0, :, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_scores_equal_each_sequence_scored_alone(folders, arch):
    model = load_full_reward_model(load_reward_model_spec(folders[arch]))
    want = torch.tensor([_alone(model, ids) for ids in SEQUENCES])
    packed = pack_sequences(SEQUENCES, [[] for _ in SEQUENCES], pad_to=sum(map(len, SEQUENCES)) + 6)
    with packed_attention(model, "sdpa_segments"):
        got = score_packed(model, packed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The test has power: every other position a wrong reader could pick (a neighbour of the sequence's end, the
    # next sequence's first token, the row's end) holds a different score.
    for i, ids in enumerate(SEQUENCES):
        alone_T = _per_token_scores(model, ids)
        assert (alone_T[:-1] - want[i]).abs().min() > 1e-3
        assert all(abs(float(want[j]) - float(want[i])) > 1e-3 for j in range(len(SEQUENCES)) if j != i)


def test_score_sequences_over_several_packs_and_an_empty_one(folders):
    model = load_full_reward_model(load_reward_model_spec(folders["qwen2"]))
    want = torch.tensor([_alone(model, ids) for ids in SEQUENCES])
    with packed_attention(model, "sdpa_segments"):
        got = score_sequences(model, SEQUENCES, [[2, 0], [], [3], [1]], device="cpu")
        empty = score_packed(model, pack_sequences([], [], pad_to=4))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_scores_from_text_with_a_chat_template(folders):
    spec = load_reward_model_spec(folders["chat"])
    model = load_full_reward_model(spec)
    pairs = [("copy 1 2 =", " 1 2"), ("sort 3 1 =", " 1 3 3"), ("a", "b")]
    ids = [reward_input_ids(spec, p, c) for p, c in pairs]
    with packed_attention(model, "sdpa_segments"):
        got = score_sequences(model, ids, [[0, 1, 2]], device="cpu")
    torch.testing.assert_close(got, torch.tensor([_alone(model, x) for x in ids]), rtol=0, atol=1e-5)


def test_scoring_refuses_an_attention_that_crosses_sequences(folders):
    model = load_full_reward_model(load_reward_model_spec(folders["llama"]))
    with pytest.raises(ValueError, match="set_attention"):
        score_packed(model, pack_sequences(SEQUENCES, [[] for _ in SEQUENCES]))


# ---- the critic from a reward model ----------------------------------------------------------------------------


def _value_config():
    return config_for("value", resolve_config(path=None, config=TINY_CONFIG))


def test_the_critic_from_a_reward_model_scores_each_last_token_as_the_reward_model(folders):
    spec = load_reward_model_spec(folders["policy_shaped"])
    reward = load_full_reward_model(spec)
    state = value_state_dict_from_reward_model(reward.state_dict(), reward_config=spec.config,
                                               value_config=_value_config(), reward_path=spec.path)
    critic = AutoModelForTokenClassification.from_config(_value_config())
    critic.load_state_dict(state, strict=True)
    for ids in SEQUENCES:
        with torch.no_grad():
            values_T = critic(input_ids=torch.tensor([ids])).logits[0, :, 0]
        assert abs(float(values_T[-1]) - _alone(reward, ids)) < 1e-5


def test_the_critic_refuses_a_reward_model_of_another_architecture(folders):
    spec = load_reward_model_spec(folders["qwen2"])
    reward = load_full_reward_model(spec)
    with pytest.raises(ConfigError) as caught:
        value_state_dict_from_reward_model(reward.state_dict(), reward_config=spec.config,
                                           value_config=_value_config(), reward_path=spec.path)
    message = str(caught.value)
    assert "Qwen2ForSequenceClassification (qwen2" in message and "(llama, hidden 64" in message, message


# ---- sharded (a world of one) ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    fdist.init_distributed(device_type="cpu")
    return fdist.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")


def _offload_policies(model) -> set[str]:
    from torch.distributed.fsdp import FSDPModule

    return {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
            for m in model.modules() if isinstance(m, FSDPModule)}


@pytest.mark.parametrize("offload", [False, True])
def test_the_sharded_reward_model_is_frozen_and_scores_like_the_plain_one(folders, mesh, offload):
    spec = load_reward_model_spec(folders["llama"])
    plain = load_full_reward_model(spec)
    model = build_reward_model(spec, mesh=mesh, offload=offload)
    assert _offload_policies(model) == {"CPUOffloadPolicy" if offload else "OffloadPolicy"}
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    set_attention(model, "sdpa_segments")
    got = score_sequences(model, SEQUENCES, [[0, 1], [2, 3]], device="cpu")
    model.reshard()
    torch.testing.assert_close(got, torch.tensor([_alone(plain, ids) for ids in SEQUENCES]), rtol=0, atol=1e-5)


def test_the_sharded_critic_from_a_reward_model(folders, mesh):
    spec = load_reward_model_spec(folders["policy_shaped"])
    reward = load_full_reward_model(spec)
    critic = build_value_model_from_reward_model(spec, policy_tokenizer=load_bundled_tokenizer(), path=None,
                                                 config=TINY_CONFIG, mesh=mesh)
    assert critic.training and all(p.requires_grad for p in critic.parameters())
    for ids in SEQUENCES:
        with torch.no_grad():
            value = float(critic(input_ids=torch.tensor([ids])).logits[0, -1, 0])
        assert abs(value - _alone(reward, ids)) < 1e-5


def test_the_critic_refuses_a_reward_model_with_another_tokenizer(folders, mesh):
    spec = load_reward_model_spec(folders["llama"])
    with pytest.raises(ConfigError, match="has its own tokenizer"):
        build_value_model_from_reward_model(spec, policy_tokenizer=load_bundled_tokenizer(), path=None,
                                            config=TINY_CONFIG, mesh=mesh)


@pytest.mark.parametrize("offload", [False, True])
def test_the_offload_setting_reaches_the_reward_model_from_the_config(folders, mesh, offload):
    """`reward.model_offload` through the trainer's own set-up: the built reward model's FSDP2 units carry the CPU
    offload policy exactly when the config asks (on a GPU that keeps its shards on the CPU between scorings)."""
    from fsdptrain.config.compose import compose_config
    from fsdptrain.data.tokenizer import load_bundled_tokenizer
    from fsdptrain.train.setup import build_models

    cfg = compose_config(["algorithm=grpo", f"reward.models=[{folders['llama']}]",
                          f"reward.model_offload={str(offload).lower()}"])
    models = build_models(cfg, load_bundled_tokenizer(), mesh, torch.device("cpu"), num_steps=1)
    (reward_model,) = models.reward_models
    assert _offload_policies(reward_model) == {"CPUOffloadPolicy" if offload else "OffloadPolicy"}
    assert _offload_policies(models.policy) == {"OffloadPolicy"}  # the setting is the reward model's alone
