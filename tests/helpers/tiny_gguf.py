"""A tiny Llama written as a GGUF file by the ``gguf`` package, the way llama.cpp's converter writes one.

The file holds fp32 tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ...), with the query and key
rows permuted into llama.cpp's rotary layout (transformers' GGUF loader undoes it), and a byte-level (``gpt2``)
vocabulary with its merges, control tokens and a chat template. Loaded back, the model's weights are the source
model's exactly, so a test can compare against the plain transformers model as an independent reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("1 2", "Ġ 1", "r e", "re p")
NUM_HEADS, NUM_KV_HEADS = 4, 2


def tiny_vocabulary() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = ["".join(merge.split(" ")) for merge in MERGES]
    return [*SPECIAL_TOKENS, *bytes_to_unicode().values(), *merged]


def tiny_llama(seed: int = 0):
    """The source model: a 2-layer Llama over ``tiny_vocabulary()`` (bos <|im_start|>, eos = pad <|im_end|>)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tiny_vocabulary()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _rotary_permute(weight, num_heads: int):
    """llama.cpp's layout of q/k rows: each head's two rotary halves interleaved."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(file: Path, model) -> Path:
    """Write ``model`` (from ``tiny_llama``) and the tiny vocabulary to ``file`` as a GGUF; returns ``file``."""
    import gguf

    config = model.config
    tokens = tiny_vocabulary()
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))  # 3: control
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    weights = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for hf_name, gguf_name in names.items():
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", weights[f"{layer}{hf_name}.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight",
                          _rotary_permute(weights[f"{layer}self_attn.q_proj.weight"], config.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight",
                          _rotary_permute(weights[f"{layer}self_attn.k_proj.weight"], config.num_key_value_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file
