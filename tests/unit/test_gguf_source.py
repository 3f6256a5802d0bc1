"""A GGUF file as the model source (fsdptrain/model/location.py): the policy, the value model's backbone and the
tokenizer fsdptrain loads from it are transformers' own GGUF load, and the source model's weights exactly; bad
``model.path`` / ``model.gguf_file`` values are one line each."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.model.loading import build_full_model, resolve_config
from fsdptrain.model.checks import check_model_source
from fsdptrain.model.location import gguf_package_problem, model_location, pretrained_args
from tests.helpers.tiny_gguf import CHAT_TEMPLATE, tiny_llama, write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    source = tiny_llama()
    file = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q.gguf", source)
    return source, file


def test_policy_from_gguf_is_transformers_gguf_load_and_the_source_weights(gguf_model):
    from transformers import AutoModelForCausalLM

    source, file = gguf_model
    policy = build_full_model("policy", path=str(file), config=None, seed=0).eval()
    reference = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 20, 21, 259, 2, 40, 41, 260, 7]])
    with torch.no_grad():
        logits = policy(ids).logits
        assert torch.equal(logits, reference(ids).logits)
        assert torch.equal(logits, source(ids).logits)  # fp32 tensors in the file: the weights come back exactly
    assert resolve_config(path=str(file), config=None).num_key_value_heads == 2


def test_value_model_backbone_from_gguf(gguf_model):
    source, file = gguf_model
    policy = build_full_model("policy", path=str(file), config=None, seed=0)
    value = build_full_model("value", path=str(file), config=None, seed=1, backbone_from=policy)
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(value.base_model.state_dict()[name], tensor), name
    assert value.score.weight.shape == (1, 32)


def test_tokenizer_and_chat_template_from_gguf(gguf_model, tmp_path):
    from transformers import AutoTokenizer

    from fsdptrain.model.loading import build_tokenizer

    _, file = gguf_model
    cfg = type("Cfg", (), {"model": type("M", (), {"path": str(file.parent), "gguf_file": file.name})})()
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == ("<|im_end|>", "<|im_end|>", "left")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "rep 12"}], add_generation_prompt=True,
                                        return_dict=False)
    own = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    assert ids == own.apply_chat_template([{"role": "user", "content": "rep 12"}], add_generation_prompt=True,
                                          return_dict=False)
    assert tokenizer.decode(ids) == "<|im_start|>user\nrep 12<|im_end|>\n<|im_start|>assistant\n"
    # the merges apply in the file's order: "1 2" ranks before "Ġ 1", so " 12" is "Ġ" + "12"
    assert tokenizer.convert_ids_to_tokens(tokenizer("rep 12")["input_ids"]) == ["rep", "Ġ", "12"]


def test_model_location_and_pretrained_args(tmp_path):
    assert model_location(None, None) is None
    assert model_location("/m", None) == "/m"
    assert model_location("/m", "x.gguf") == "/m/x.gguf"
    assert pretrained_args("/m") == ("/m", {})
    file = tmp_path / "a.GGUF"
    assert pretrained_args(str(file)) == (str(tmp_path), {"gguf_file": str(file)})


def test_bad_gguf_sources_are_one_line(gguf_model, tmp_path):
    _, file = gguf_model
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"PK\x03\x04")
    cases = [
        ((str(tmp_path / "missing.gguf"), None), "no such file"),
        ((str(not_gguf), None), "is not a GGUF file"),
        ((None, "x.gguf"), "model.gguf_file='x.gguf' needs model.path="),
        ((str(file), "x.gguf"), "is already a .gguf file: drop model.gguf_file"),
        ((str(file.parent), "weights.bin"), "is not a .gguf file"),
        ((str(tmp_path / "nofolder"), "x.gguf"), "no such folder"),
        ((str(file.parent), "missing.gguf"), "no such file"),
    ]
    for (path, gguf_file), message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            check_model_source(path, gguf_file)
    check_model_source(str(file), None)
    check_model_source(str(file.parent), file.name)


def test_missing_gguf_package_names_the_extra(gguf_model, monkeypatch):
    _, file = gguf_model
    real_version = metadata.version

    def version(name):
        if name == "gguf":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    assert gguf_package_problem() == "needs the gguf package: pip install 'fsdptrain[gguf]'"
    with pytest.raises(ConfigError) as err:
        check_model_source(str(file), None)
    assert str(err.value) == f"model.path: {str(file)!r} is a GGUF file; reading it needs the gguf package: " \
                             f"pip install 'fsdptrain[gguf]'"
    monkeypatch.setattr(metadata, "version", lambda name: "0.9.1" if name == "gguf" else real_version(name))
    assert gguf_package_problem() == "needs gguf>=0.10 (installed: 0.9.1): pip install -U 'fsdptrain[gguf]'"


@pytest.mark.parametrize("keep", [30, 200, 0.5, -10])
def test_a_gguf_file_cut_short_is_one_line_naming_it(gguf_model, tmp_path, keep):
    _, file = gguf_model
    data = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ConfigError) as err:
        check_model_source(str(cut), None)
    assert str(err.value).startswith(f"model.path: {str(cut)!r} is damaged (") and "\n" not in str(err.value)
    assert "cut short or not a whole GGUF file" in str(err.value)
