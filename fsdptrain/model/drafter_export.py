"""The co-trained drafter on disk: the EAGLE-3 checkpoint folder that vLLM and SGLang load (config.json and
model.safetensors), written by `export_drafter` and read back by `load_drafter` (docs/drafter.md, "Export and
serving")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import LlamaConfig, PretrainedConfig

from fsdptrain.model.drafter import DraftVocab, Eagle3Drafter

ARCHITECTURE = "LlamaForCausalLMEagle3"
"""The architecture name both engines map to their EAGLE-3 Llama head (vLLM also accepts Eagle3LlamaForCausalLM)."""

WEIGHTS_NAME = "model.safetensors"


# ---- export in the EAGLE-3 layout --------------------------------------------------------------------------------


def _rope_fields(config: LlamaConfig) -> dict:
    rope = dict(config.rope_parameters)
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    return {"rope_theta": rope.get("rope_theta"), "rope_scaling": scaling, "rope_parameters": rope}


def export_drafter(drafter: Eagle3Drafter, path: str | os.PathLike, target_config: PretrainedConfig, *,
                   dtype: Optional[torch.dtype] = None, embed_tokens: Optional[Tensor] = None) -> Path:
    """Write `drafter` as an EAGLE-3 checkpoint folder that vLLM and SGLang load: config.json (architecture
    `LlamaForCausalLMEagle3`, draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids) and
    model.safetensors (fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d; embed_tokens.weight only when
    given, else the engines use the target's). `dtype` casts the float weights (default: as trained). A plain,
    unsharded drafter on rank 0 (gather it first under FSDP)."""
    config = drafter.config
    if target_config.hidden_size != config.target_hidden_size or target_config.vocab_size != config.vocab_size:
        raise ValueError("the drafter was built for another target (hidden size or vocabulary differ)")
    state = {}
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    if embed_tokens is not None:
        state["embed_tokens.weight"] = embed_tokens.detach().cpu().to(state["fc.weight"].dtype).contiguous()
    weight_dtype = str(state["fc.weight"].dtype).removeprefix("torch.")
    fields = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        **_rope_fields(config),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": weight_dtype,
        "eagle_aux_hidden_state_layer_ids": list(drafter.feature_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(drafter.feature_layers),
                         "use_aux_hidden_state": True},
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def load_drafter(path: str | os.PathLike) -> Eagle3Drafter:
    """Rebuild an `Eagle3Drafter` from a folder written by `export_drafter` (strict: every weight accounted for;
    an `embed_tokens.weight` in the file is ignored, the drafter reads the policy's embeddings)."""
    folder = Path(path)
    fields = json.loads((folder / "config.json").read_text())
    if ARCHITECTURE not in fields.get("architectures", []):
        raise ValueError(f"{folder} is not an EAGLE-3 drafter folder (architectures {fields.get('architectures')})")
    layers = fields.pop("eagle_aux_hidden_state_layer_ids")
    for key in ("architectures", "model_type", "eagle_config", "rope_theta", "rope_scaling", "torch_dtype"):
        fields.pop(key, None)
    config = LlamaConfig(**fields)
    state = load_file(str(folder / WEIGHTS_NAME))
    state.pop("embed_tokens.weight", None)
    vocab = DraftVocab(d2t=state["d2t"], t2d=state["t2d"])
    drafter = Eagle3Drafter(config, vocab, layers)
    drafter.to(state["fc.weight"].dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter
