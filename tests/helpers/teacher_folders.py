"""Distillation teachers for tests: a tiny causal LM with the bundled tokenizer (the config-built student's), drawn
from its own seed and saved with save_pretrained, and one whose tokenizer differs from the student's."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.model.loading import TINY_CONFIG, build_full_model


def save_teacher(folder: Path, *, seed: int = 7, sharpen: float = 1.0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """The default tiny architecture, weights from ``seed``, its final norm scaled by ``sharpen`` (logits times
    ``sharpen``: a peaked teacher, far from a fresh student), with the bundled tokenizer (plus ``extra_tokens``, which
    make its vocabulary differ from the student's), saved into ``folder``."""
    tokenizer = load_bundled_tokenizer()
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    config = {**TINY_CONFIG, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    model = build_full_model("policy", path=None, config=config, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
