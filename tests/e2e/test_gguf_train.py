"""``fsdptrain train model.path=<file.gguf>`` through the real CLI: policy and critic start from the file, it trains,
and the export is a plain Hugging Face folder (safetensors, no GGUF quantization config) holding the trained weights
and the GGUF's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.tiny_gguf import CHAT_TEMPLATE, tiny_llama, write_tiny_gguf

pytest.importorskip("gguf")

TINY = ("rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=3", "trainer.eval_every=0",
        "logging.progress=false", "trainer.steps=2")  # PPO: the value model starts from the GGUF too


def test_gguf_file_trains_and_exports_a_plain_folder(cli, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_llama()
    file = write_tiny_gguf(tmp_path / "tiny.gguf", source)
    result = cli("train", "model=local", f"model.path={file}", *TINY, "trainer.run_name=gguf")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "gguf"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    export = run / "export" / "policy"
    config = json.loads((export / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (export / "model.safetensors").is_file()
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    moved = [name for name, tensor in source.state_dict().items()
             if not torch.equal(exported.state_dict()[name], tensor)]
    assert moved, "the export holds the GGUF's weights unchanged: nothing trained"
    assert AutoTokenizer.from_pretrained(export).chat_template == CHAT_TEMPLATE
    assert (run / "export" / "critic" / "model.safetensors").is_file()
