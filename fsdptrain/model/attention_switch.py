"""Choosing and switching the packed attention backend of a model, registered with transformers' AttentionInterface.

A packed row `[1, T]` holds several sequences (see fsdptrain/data/packing.py). Attention must never cross a sequence
boundary; the backends in fsdptrain/model/attention_backends.py do that, and this module chooses one and switches a
model to it. :func:`register_backends` registers them with transformers (an explicit call: :func:`set_attention` makes
it, so importing this module changes nothing).

Segments come from the `cu_seq_lens_q/k` kwargs when the caller passes them (`packed_model_inputs` does), else
from `position_ids` restarting at 0. Model features a backend cannot honour are refused with a ValueError, never
ignored (the table in docs/attention-backends.md).

These backends serve training forwards only (as many queries as keys, no cache, no padding mask): decoding steps with a
KV cache must run on sdpa, so generation uses `generation_attention` and training forwards switch with
`packed_attention` (sdpa's `is_causal` aligns top-left, so a per-segment backend would attend a decoding query to
key 0 only; docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

from fsdptrain.data.packing import PackedBatch
from fsdptrain.data.shared_prompts import SharedPromptRow
from fsdptrain.model import attention_backends
from fsdptrain.model.attention_backends import (
    AUTO,
    BACKEND_FUNCTIONS,
    BACKENDS,
    FLASH_ATTN,
    SDPA_SEGMENTS,
    TORCH_VARLEN,
    VarlenKernel,
    no_mask,
)

logger = logging.getLogger(__name__)


def register_backends() -> None:
    """Register the packed backends (and their no-op mask builders) with transformers' attention interfaces.

    Idempotent, and a name already registered is left as it is (so a test may wrap a backend); :func:`set_attention`
    calls it before switching a model to one of them.
    """
    registered = AttentionInterface()
    for name, fn in BACKEND_FUNCTIONS.items():
        if name not in registered:
            AttentionInterface.register(name, fn)
            AttentionMaskInterface.register(name, no_mask)


# --------------------------------------------------------------------------------------------------------------
# Choosing a backend
# --------------------------------------------------------------------------------------------------------------


def _cuda_supports_varlen_kernels(device: torch.device) -> bool:
    # both kernels are flash-attention 2 kernels: Ampere (sm80) or newer
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def _kernel_runs(kernel: VarlenKernel | None, device: torch.device, dtype: torch.dtype | None) -> bool:
    if kernel is None or device.type not in kernel.device_types:
        return False
    if dtype is not None and dtype not in kernel.dtypes:
        return False
    return device.type != "cuda" or _cuda_supports_varlen_kernels(device)


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None) -> list[str]:
    """The backends that can run on `device` (and `dtype`, when given), in the order `auto` prefers them."""
    device = torch.device(device)
    names = []
    if _kernel_runs(attention_backends.flash_kernel(), device, dtype):
        names.append(FLASH_ATTN)
    if _kernel_runs(attention_backends.torch_varlen_kernel(), device, dtype):
        names.append(TORCH_VARLEN)
    names.append(SDPA_SEGMENTS)
    return names


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend to use for `name` on `device`: `auto` picks the first of `available_backends` (flash_attn,
    then torch_varlen on CUDA in half precision, else sdpa_segments) and logs it; a named backend that cannot run
    there is a ValueError listing those that can."""
    available = available_backends(device, dtype)
    if name == AUTO:
        chosen = available[0]
        logger.info("packed attention: auto chose %r on %s (available: %s)", chosen, device, ", ".join(available))
        return chosen
    if name not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if name not in available:
        raise ValueError(
            f"packed attention backend {name!r} is not available on {device}"
            f"{f' for {dtype}' if dtype is not None else ''}; available here: {', '.join(available)} (or 'auto')"
        )
    return name


# --------------------------------------------------------------------------------------------------------------
# Using it with a model
# --------------------------------------------------------------------------------------------------------------


def packed_model_inputs(packed: PackedBatch) -> dict[str, Any]:
    """Keyword arguments for an HF causal LM's forward on one packed row (tensors on the pack's device).

    `use_cache=False` and `attention_mask=None` are not optional: a cache or a 2-D mask makes transformers skip
    its packed-sequence handling (docs/attention-backends.md). The padding tail, if any, is a segment of its own.
    """
    cu = packed.segment_cu_seqlens()
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "attention_mask": None,
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": packed.max_seqlen,
        "max_length_k": packed.max_seqlen,
    }


def shared_model_inputs(row: SharedPromptRow) -> dict[str, Any]:
    """Keyword arguments for an HF causal LM's forward on the model row of a shared-prompt pack: one segment per
    group, and `prompt_branches`, the attention within each group, which transformers hands through to the packed
    backends (docs/packing.md, "Shared prompts")."""
    return {
        "input_ids": row.input_ids,
        "position_ids": row.position_ids,
        "attention_mask": None,
        "use_cache": False,
        "cu_seq_lens_q": row.cu_seqlens,
        "cu_seq_lens_k": row.cu_seqlens,
        "max_length_q": row.max_seqlen,
        "max_length_k": row.max_seqlen,
        "prompt_branches": row.branches,
    }


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


def set_attention(model: torch.nn.Module, name: str) -> None:
    """Switch `model` (and its sub-models) to the attention implementation `name`, and check it took.

    transformers' `set_attn_implementation` special-cases names by substring: one containing "sdpa" must pass the
    model's sdpa check (Gemma2 fails it, although `sdpa_segments` honours its soft-capping), and one containing
    "flash" may be swapped for the model's preferred flash kernel with only a warning. So our own backends are set
    on the configs directly (what `set_attn_implementation` does after its checks); any other name goes through
    `set_attn_implementation`. Either way a model whose attention ignores the AttentionInterface is refused.
    """
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    if name in BACKENDS:
        register_backends()
        if not model._can_set_attn_implementation():
            raise ValueError(
                f"{type(model).__name__} does not dispatch its attention through transformers' AttentionInterface, "
                f"so it cannot run packed attention"
            )
        for module in model.modules():
            if isinstance(module, PreTrainedModel):
                module.config._attn_implementation_internal = name
    else:
        model.set_attn_implementation(name)
    actual = model.config._attn_implementation
    if actual != name:
        raise ValueError(f"asked {type(model).__name__} for attention {name!r} but transformers set {actual!r}")


@contextlib.contextmanager
def packed_attention(
    model: torch.nn.Module, backend: str = AUTO, *, dtype: torch.dtype | None = None
) -> Iterator[str]:
    """Run the block with `model` on a packed backend, then restore its previous attention (e.g. sdpa for
    generation). Yields the backend's name. `dtype` is the activations' dtype when it differs from the parameters'
    (mixed precision); it steers `auto` away from the half-precision kernels for fp32."""
    device, param_dtype = _model_device_dtype(model)
    with generation_attention(model, resolve_backend(backend, device, dtype or param_dtype)) as name:
        yield name


@contextlib.contextmanager
def generation_attention(model: torch.nn.Module, name: str = "sdpa") -> Iterator[str]:
    """Run the block with `model` on `name` (default sdpa, for generation), then restore its previous attention."""
    previous = model.config._attn_implementation
    set_attention(model, name)
    try:
        yield name
    finally:
        set_attention(model, previous)
