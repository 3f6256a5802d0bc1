"""A model folder's tokenizer that cannot serve its model, and a chat template that fails on the data: one line at
start-up, before any model is built (issue 32, item 5). The folders are real: the bundled tokenizer saved with
save_pretrained next to a config.json, loaded by the trainer's own build_tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import PreTrainedTokenizerFast

from fsdptrain.config import ConfigError
from fsdptrain.data.prompts import render_prompt
from fsdptrain.data.tokenizer import TOKENIZER_PATH, load_bundled_tokenizer
from fsdptrain.train.setup import build_tokenizer


def _folder(path: Path, tokenizer, *, vocab_size: int) -> Path:
    path.mkdir()
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "vocab_size": vocab_size}))
    return path


def _build(path: Path):
    return build_tokenizer(OmegaConf.create({"model": {"path": str(path), "gguf_file": None}}))


def test_a_tokenizer_that_cannot_serve_its_model_is_one_line(tmp_path):
    bundled = load_bundled_tokenizer()
    assert _build(_folder(tmp_path / "ok", bundled, vocab_size=len(bundled))).pad_token_id == 0

    no_specials = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH), unk_token="<unk>")
    folder = _folder(tmp_path / "no_pad_no_eos", no_specials, vocab_size=len(bundled))
    with pytest.raises(ConfigError) as err:
        _build(folder)
    assert str(err.value) == (f"model.path={str(folder)!r}: the tokenizer has neither a pad token nor an EOS token; "
                              "set at least eos_token (e.g. tokenizer.eos_token = '</s>') and save it with "
                              "save_pretrained")

    folder = _folder(tmp_path / "small_embedding", bundled, vocab_size=len(bundled) - 4)
    with pytest.raises(ConfigError) as err:
        _build(folder)
    assert str(err.value) == (f"model.path={str(folder)!r}: the tokenizer has {len(bundled)} tokens but the model's "
                              f"embedding has {len(bundled) - 4} rows (config.json vocab_size); resize the model to "
                              "the tokenizer (model.resize_token_embeddings(len(tokenizer))) and save both")


def test_a_chat_template_that_fails_on_the_datas_roles_is_one_line_naming_the_row():
    tokenizer = load_bundled_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                               "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    chat = [{"role": "user", "content": "repeat 3"}]
    assert render_prompt(chat, tokenizer=tokenizer, where="x") == ("repeat 3", True)
    with pytest.raises(ConfigError) as err:
        render_prompt([{"role": "system", "content": "be brief"}, *chat], tokenizer=tokenizer,
                      where="train.jsonl: row 4 (0-based), column 'prompt'")
    assert str(err.value) == ("train.jsonl: row 4 (0-based), column 'prompt': the tokenizer's chat template fails on "
                              "this chat (roles system, user): TemplateError: Conversation roles must be "
                              "user/assistant")
