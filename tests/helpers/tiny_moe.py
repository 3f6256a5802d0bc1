"""A tiny Qwen3-MoE policy folder for tests: built from its config with the bundled tokenizer and saved with
save_pretrained. ``router_scale`` multiplies every router's weights: a small one makes the routers' probabilities
nearly equal (near-ties), where generation and training disagree on the experts without routing replay."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.model.moe import moe_layers

TINY_MOE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=256, tie_word_embeddings=True, output_router_logits=False)


def tiny_moe(*, seed: int = 0, router_scale: float = 1.0, **overrides) -> Qwen3MoeForCausalLM:
    """The tiny Qwen3-MoE sized to the bundled tokenizer, fp32, weights from ``seed``, routers times
    ``router_scale``."""
    tokenizer = load_bundled_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **{**TINY_MOE, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(0.0, 0.02).mul_(router_scale)
    return model.eval()


def save_tiny_moe(folder: Path, **kwargs) -> Path:
    """:func:`tiny_moe` and the bundled tokenizer saved into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_moe(**kwargs).save_pretrained(folder)
    load_bundled_tokenizer().save_pretrained(folder)
    return folder
