"""Hostile files a user brings (issue 42): each is one ConfigError naming the file, raised by the checks the CLI runs
before any run folder or rank exists (fsdptrain/model/checks.py)."""

from __future__ import annotations

import os

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.model.checks import check_model_source


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo the pickle ran",))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    folder = tmp_path_factory.mktemp("m")
    tokenizer = load_bundled_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    return folder, model.state_dict()


@pytest.mark.parametrize("payload, legacy", [("code", False), ("code", True), ("code in a list", False)])
def test_a_weights_pickle_that_names_code_is_one_line(model_folder, payload, legacy):
    folder, _ = model_folder
    obj = {"x": _RunsCode()} if payload == "code" else [torch.zeros(2), _RunsCode()]
    torch.save(obj, folder / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ConfigError) as err:
        check_model_source(str(folder), None)
    message = str(err.value)
    assert message.startswith(f"model.path={str(folder)!r}: pytorch_model.bin is a pickle that names ")
    assert "system" in message and "save the weights as safetensors" in message and "\n" not in message


@pytest.mark.parametrize("dtype, legacy", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_a_torch_saved_state_dict_passes(model_folder, dtype, legacy):
    folder, state = model_folder
    torch.save({k: v.to(dtype) for k, v in state.items()}, folder / "pytorch_model.bin",
               _use_new_zipfile_serialization=not legacy)
    check_model_source(str(folder), None)


def test_a_weights_file_cut_short_is_one_line(model_folder):
    folder, state = model_folder
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[:40])
    with pytest.raises(ConfigError, match=r"pytorch_model.bin is damaged \(not a whole torch.save file\)"):
        check_model_source(str(folder), None)
