"""A tiny Qwen3-MoE causal LM (4 experts, top-2, every layer sparse) with the bundled tokenizer, saved with
save_pretrained: what a user's MoE folder looks like to ``model=local``."""

from __future__ import annotations

from pathlib import Path

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.model.loading import build_full_model

TINY_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=256,
                      output_router_logits=False, tie_word_embeddings=True)


def save_tiny_moe(folder: Path, *, seed: int = 0, **overrides) -> Path:
    """The tiny Qwen3-MoE (``TINY_QWEN3_MOE`` with ``overrides``), weights drawn from ``seed``, and the bundled
    tokenizer, saved into ``folder``."""
    tokenizer = load_bundled_tokenizer()
    config = {**TINY_QWEN3_MOE, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **overrides}
    model = build_full_model("policy", path=None, config=config, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
