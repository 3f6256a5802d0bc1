"""What one attention call asks for: the segments of a packed row, causality, scale, window, soft-cap, sinks.

Every packed backend (fsdptrain/model/varlen.py) reads its call through :func:`read_call`, so a feature no backend
implements is refused with one error rather than ignored (docs/packing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FLASH_ATTN = "flash_attn"


TORCH_VARLEN = "torch_varlen"


SDPA_SEGMENTS = "sdpa_segments"


AUTO = "auto"


BACKENDS = (FLASH_ATTN, TORCH_VARLEN, SDPA_SEGMENTS)
"""In the order `auto` prefers them."""


_UNSUPPORTED_KWARGS = ("position_bias", "head_mask", "indices", "block_indices")


@dataclass(frozen=True)
class AttentionCall:
    """One attention call's request, checked and normalised."""

    backend: str
    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], covers the whole row
    max_seqlen: int | None  # None: not given, compute it when needed
    is_causal: bool
    scaling: float
    dropout: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None  # [Hq], one learned logit per head

    def bounds(self) -> list[int]:
        return self.cu_seqlens.tolist()

    def longest(self) -> int:
        if self.max_seqlen is not None:
            return int(self.max_seqlen)
        return int(self.cu_seqlens.diff().max().item())


def refuse(backend: str, feature: str, fix: str) -> ValueError:
    return ValueError(f"attention backend {backend!r} cannot honour {feature}; {fix}")


def _segments_from_position_ids(position_ids: torch.Tensor, total_len: int, backend: str) -> torch.Tensor:
    """int32 cu_seqlens from position ids that count 0, 1, ... within each segment."""
    pos_T = position_ids.reshape(-1)
    if pos_T.numel() != total_len:
        raise ValueError(
            f"{backend}: position_ids hold {pos_T.numel()} positions for a row of {total_len}; pass position_ids "
            f"of shape [1, T]"
        )
    starts = torch.nonzero(pos_T == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(
            f"{backend}: position_ids must start at 0 and restart at 0 at every packed sequence (got "
            f"{pos_T[:8].tolist()}...); build the row with fsdptrain.packing.pack_sequences"
        )
    cu = torch.cat([starts, torch.tensor([total_len], device=pos_T.device)])
    # within a segment the positions must be 0, 1, 2, ...: anything else means the row is not a packed row
    seg_start_T = torch.repeat_interleave(starts, cu.diff())
    expected_T = torch.arange(total_len, device=pos_T.device) - seg_start_T
    if not torch.equal(pos_T, expected_T):
        raise ValueError(
            f"{backend}: position_ids do not count up by one from each 0; a packed row needs positions that "
            f"restart at 0 per sequence and no padding mask"
        )
    return cu.to(torch.int32)


def _segments(total_len: int, kwargs: dict[str, Any], backend: str) -> tuple[torch.Tensor, int | None]:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or (cu_q is not cu_k and not torch.equal(cu_q, cu_k)):
            raise refuse(backend, "different query and key segments", "pass the same cu_seq_lens_q and _k")
        if cu_q.dim() != 1 or cu_q.numel() < 2:
            raise ValueError(f"{backend}: cu_seq_lens_q must be 1-D [num_segments + 1], got {tuple(cu_q.shape)}")
        # the values are checked where that costs no device sync; on CUDA the caller's cu_seqlens are trusted
        if not cu_q.is_cuda and (int(cu_q[0]) != 0 or int(cu_q[-1]) != total_len):
            raise ValueError(
                f"{backend}: cu_seq_lens_q must run from 0 to the row length {total_len} (got {int(cu_q[0])} .. "
                f"{int(cu_q[-1])}); a padding tail must be a segment of its own (PackedBatch.segment_cu_seqlens)"
            )
        return cu_q.to(torch.int32), kwargs.get("max_length_q")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            f"{backend}: no segments given: pass cu_seq_lens_q/k (fsdptrain.attention.packed_model_inputs does) "
            f"or position_ids that restart at 0 per sequence"
        )
    return _segments_from_position_ids(position_ids, total_len, backend), None


def read_call(
    backend: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> AttentionCall:
    if attention_mask is not None:
        raise ValueError(
            f"{backend} got an attention mask; packed rows take attention_mask=None (segments come from "
            f"cu_seq_lens or position_ids). Use fsdptrain.attention.packed_model_inputs, and sdpa for padded "
            f"batches and generation"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{backend} takes one packed row [1, T]; got a batch of {query.shape[0]} rows")
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{backend} serves training forwards only: got {query.shape[2]} queries for {key.shape[2]} keys (a KV "
            f"cache). Generate on sdpa: wrap training forwards in fsdptrain.attention.packed_attention(model)"
        )
    if kwargs.get("output_attentions"):
        raise refuse(backend, "output_attentions=True", "use eager attention to get attention weights")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise refuse(backend, f"`{name}`", "use the model's own attention implementation (eager or sdpa)")

    total_len = query.shape[2]
    cu_seqlens, max_seqlen = _segments(total_len, kwargs, backend)
    is_causal = kwargs.get("is_causal")
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None and not is_causal:
        raise refuse(backend, "a sliding window on non-causal attention", "use eager attention")
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    return AttentionCall(
        backend=backend,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        is_causal=is_causal,
        scaling=float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
        dropout=float(dropout or 0.0),
        sliding_window=int(sliding_window) if sliding_window is not None else None,
        softcap=float(kwargs["softcap"]) if kwargs.get("softcap") is not None else None,
        sinks=sinks,
    )
