"""A tiny random Llama for tests that need a real transformers causal LM: ``tiny_llama(vocab_size, **overrides)``."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_llama(vocab_size: int, *, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """``LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **TINY_LLAMA, **overrides))``, its weights drawn right
    after ``torch.manual_seed(seed)`` (so the same arguments give the same weights)."""
    config = LlamaConfig(vocab_size=vocab_size, **{**TINY_LLAMA, **overrides})
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
