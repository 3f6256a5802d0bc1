"""Tiny mixture-of-experts models for tests, built from their configs (4 experts, top-2, 2 layers, 32 wide) with a
tokenizer (the bundled one unless given):

- ``write_tiny_moe(folder, arch)``: a Qwen3-MoE, Mixtral or OLMoE folder saved with ``save_pretrained``, with
  ``output_router_logits: true`` as an MoE config asks for its aux loss;
- ``tiny_moe()`` / ``save_tiny_moe(folder)``: a Qwen3-MoE model (or its folder) whose routers may nearly tie:
  ``router_spread``: each router's rows (one per expert) are one shared row plus that much noise relative to it, so
  the routers' logits nearly tie (a spread near float32's rounding, 1e-7, makes generation and training disagree
  on the experts of some tokens without routing replay); None: the default init.
"""

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

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.model.moe import moe_layers

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
        tokenizer = load_bundled_tokenizer()
    torch.manual_seed(seed)
    ARCHS[arch][1](tiny_moe_config(arch, tokenizer, **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


TINY_MOE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=256, tie_word_embeddings=True, output_router_logits=False)


def tiny_moe(*, seed: int = 0, router_spread: float | None = None, tokenizer=None, **overrides) -> Qwen3MoeForCausalLM:
    """The tiny Qwen3-MoE sized to ``tokenizer`` (default: the bundled one), fp32, weights from ``seed``, routers
    with ``router_spread`` (the module docstring)."""
    tokenizer = tokenizer if tokenizer is not None else load_bundled_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **{**TINY_MOE, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for layer in moe_layers(model):
            weight = layer.router.weight
            if router_spread is not None:
                shared = torch.randn(1, weight.shape[1])
                weight.copy_(shared + router_spread * torch.randn_like(weight))
    return model.eval()


def save_tiny_moe(folder: Path, *, tokenizer=None, **kwargs) -> Path:
    """:func:`tiny_moe` and its tokenizer saved into ``folder``."""
    tokenizer = tokenizer if tokenizer is not None else load_bundled_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    tiny_moe(tokenizer=tokenizer, **kwargs).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
