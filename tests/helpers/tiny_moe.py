"""Tiny mixture-of-experts folders for tests: ``write_tiny_moe(folder, arch)`` saves a Qwen3-MoE, Mixtral or OLMoE
(4 experts, top-2, 2 layers, 32 wide, ``output_router_logits: true`` as an MoE config asks for its aux loss) with
``save_pretrained`` and a tokenizer (the bundled one unless given), its weights drawn from ``seed``."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ARCHS = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=4, moe_intermediate_size=16, head_dim=8)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, intermediate_size=32)),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=4, intermediate_size=32)),
}


def tiny_moe_config(arch: str, tokenizer, **overrides):
    config_class, _, own = ARCHS[arch]
    return config_class(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=512, num_experts_per_tok=2,
                        output_router_logits=True, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **{**own, **overrides})


def write_tiny_moe(folder: Path, arch: str, *, tokenizer=None, seed: int = 0, **overrides) -> Path:
    if tokenizer is None:
        from fsdptrain.data.tokenizer import load_bundled_tokenizer

        tokenizer = load_bundled_tokenizer()
    torch.manual_seed(seed)
    ARCHS[arch][1](tiny_moe_config(arch, tokenizer, **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
