"""Hugging Face export: a trained (FSDP2-sharded or plain) model as a `save_pretrained` folder of safetensors.

The full state dict is gathered to rank 0's CPU (one parameter at a time, so host memory holds one copy of the
weights), put into a plain copy of the model built on the meta device from the model's config (no random init, no
second copy), and saved with `save_pretrained(safe_serialization=True)`, with the tokenizer when one is given. The
folder loads back with `AutoModelForCausalLM.from_pretrained` (policy) or `AutoModelForTokenClassification` (critic)
and holds no pickled code.

A model with LoRA adapters (docs/lora.md) exports three ways from the same gathered state: the adapter in peft's own
format (loads with ``PeftModel.from_pretrained(base, folder)``), the merged model (W + (alpha / r) B A, a plain
folder) and, when the base came from a config rather than a folder, the base model it adapts.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from fsdptrain.distributed import world
from fsdptrain.model.lora import ADAPTER_NAME


def unsharded_class(model: nn.Module) -> type[PreTrainedModel]:
    """The transformers class of `model`: fully_shard swaps in a subclass (FSDP<Name>) whose bases are FSDPModule and
    the original class; this returns the original."""
    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not issubclass(cls, FSDPModule):
            return cls
    raise ValueError(f"{type(model).__name__} is not a transformers PreTrainedModel: cannot export it with "
                     f"save_pretrained")


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws a progress bar per saved shard; the trainer has its own progress display."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def export_hf(model: nn.Module, out_dir: str | os.PathLike, *, tokenizer: Any = None) -> Path:
    """Write `model` (FSDP2-sharded or plain) to `out_dir` as a Hugging Face folder: config.json, safetensors
    weights and, when given, the tokenizer. Collective when a process group exists: every rank calls it; rank 0
    writes. Returns `out_dir`.

    Non-persistent buffers (RoPE inv_freq) are not saved; transformers recomputes them from the config on load.
    """
    out_dir = Path(out_dir)
    cls = unsharded_class(model)
    rank = world.rank()
    # cpu_offload: rank 0 receives the full tensors on the CPU, other ranks an empty dict (bounded memory).
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        with torch.device("meta"):
            plain = cls._from_config(model.config, dtype=torch.float32)
        # assign: the parameters become the gathered CPU tensors themselves; strict: every weight is accounted for.
        plain.load_state_dict(full_state, strict=True, assign=True)
        plain.tie_weights()
        out_dir.mkdir(parents=True, exist_ok=True)
        with _no_progress_bars():
            plain.save_pretrained(out_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    return out_dir


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def base_state_of(adapted_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict inside an adapted model's: adapter tensors dropped, ``.base_layer`` unwrapped."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in adapted_state.items()
            if ".lora_" not in name}


def export_lora(model: nn.Module, merged_dir: str | os.PathLike, *, adapter_dir: str | os.PathLike | None,
                base_dir: str | os.PathLike | None, base_path: str | None, tokenizer: Any = None) -> None:
    """Write a model with LoRA adapters (FSDP2-sharded or plain): ``adapter_dir`` (when given) in peft's format, its
    ``base_model_name_or_path`` naming ``base_path`` (the model folder the run started from) or else ``base_dir``,
    where the base model is then written; ``merged_dir`` the merged model as a plain Hugging Face folder. Collective
    when a process group exists: every rank calls it; rank 0 writes.
    """
    from peft import get_peft_model

    cls = unsharded_class(model)
    lora_config = copy.deepcopy(model.peft_config[ADAPTER_NAME])
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # frozen weights may be stored in the param dtype (`store_frozen_in`): merge and write in fp32
    full_state = {name: t.float() if t.is_floating_point() else t for name, t in full_state.items()}
    if world.rank() == 0:
        with _no_progress_bars():
            if base_dir is not None:  # before merging: merging adds B A to the base weights in place
                _save_plain(cls, model.config, base_state_of(full_state), base_dir, tokenizer)
            with torch.device("meta"):
                plain = cls._from_config(model.config, dtype=torch.float32)
            lora_config.base_model_name_or_path = str(base_path if base_path is not None else base_dir)
            peft_model = get_peft_model(plain, lora_config, low_cpu_mem_usage=True)
            peft_model.base_model.model.load_state_dict(full_state, strict=True, assign=True)
            plain.tie_weights()
            if adapter_dir is not None:
                peft_model.save_pretrained(adapter_dir, safe_serialization=True)
            merged = peft_model.merge_and_unload()
            Path(merged_dir).mkdir(parents=True, exist_ok=True)
            merged.save_pretrained(merged_dir, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(merged_dir)
    _barrier()


def _save_plain(cls: type[PreTrainedModel], config, state: dict[str, torch.Tensor], out_dir: str | os.PathLike,
                tokenizer: Any) -> None:
    with torch.device("meta"):
        plain = cls._from_config(config, dtype=torch.float32)
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
