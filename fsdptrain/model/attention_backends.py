"""The packed attention backends, each an `attn_implementation` any HF decoder accepts unmodified, and the reading of
what one attention call asks for (the segments of a packed row, causality, scale, window, soft-cap, sinks).

Choosing a backend and switching a model to it is fsdptrain/model/attention_switch.py; this module holds what runs
inside each attention call. Every backend reads its call through :func:`read_call`, so a feature no backend
implements is refused with one error rather than ignored (docs/attention-backends.md).

Legend: the attention functions take HF's shapes: query `[1, Hq, T, D]`, key/value `[1, Hkv, T, D]` (GQA not
expanded) and return `[1, T, Hq, D]`.

- `flash_attn`:    flash-attention's `flash_attn_varlen_func` (package `flash_attn`, CUDA, fp16/bf16).
- `torch_varlen`:  torch's own `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16; it has no CPU kernel).
- `sdpa_segments`: one `scaled_dot_product_attention(is_causal=True)` per segment; exact, any device and dtype.
  Under context parallelism (a `context_shard` kwarg, `parallel.cp` > 1) it attends this rank's queries to the whole
  row's keys and values, gathered by the shard (`context_parallel_attention`).

A GPU backend reaches its kernel only through `flash_kernel()` / `torch_varlen_kernel()`, each a `VarlenKernel`
declaring the devices and dtypes it runs on; tests install a CPU stand-in there (docs/attention-backends.md).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from fsdptrain.data.shared_prompts import PromptBranches

logger = logging.getLogger(__name__)

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
    branches: PromptBranches | None = None  # shared prompts: the attention within each segment (docs/packing.md)

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
            f"{pos_T[:8].tolist()}...); build the row with fsdptrain.data.packing.pack_sequences"
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
            f"{backend}: no segments given: pass cu_seq_lens_q/k (fsdptrain.model.attention_switch.packed_model_inputs does) "
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
            f"cu_seq_lens or position_ids). Use fsdptrain.model.attention_switch.packed_model_inputs, and sdpa for padded "
            f"batches and generation"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{backend} takes one packed row [1, T]; got a batch of {query.shape[0]} rows")
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{backend} serves training forwards only: got {query.shape[2]} queries for {key.shape[2]} keys (a KV "
            f"cache). Generate on sdpa: wrap training forwards in fsdptrain.model.attention_switch.packed_attention(model)"
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
    branches = kwargs.get("prompt_branches")
    if branches is not None:
        _check_shared_prompts(backend, is_causal, sliding_window, kwargs.get("softcap"), sinks)
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
        branches=branches,
    )


def shared_prompts_blocker(config) -> str | None:
    """Why a model's attention, read from its config, cannot serve shared prompts (the features
    `_check_shared_prompts` refuses at the first forward), or None for plain causal attention. Conservative: a
    config that declares a sliding window (unless ``use_sliding_window`` is false), sliding layers, attention
    soft-capping or sinks blocks them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True) is not False:
        return f"the model ({text.model_type}) has sliding-window attention"
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        return f"the model ({text.model_type}) has sliding-window layers"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return f"the model ({text.model_type}) soft-caps its attention logits"
    if text.model_type == "gpt_oss" or getattr(text, "sinks", None) is not None:
        return f"the model ({text.model_type}) has attention sinks"
    return None


def _check_shared_prompts(backend: str, is_causal: bool, sliding_window, softcap, sinks) -> None:
    """Shared prompts (a row of `fsdptrain.data.shared_prompts`) serve plain causal attention only."""
    for present, feature in ((not is_causal, "non-causal attention"), (sliding_window is not None, "a sliding window"),
                             (softcap is not None, "logit soft-capping"), (sinks is not None, "attention sinks")):
        if present:
            raise refuse(backend, f"{feature} with shared prompts", "set trainer.share_prompts=false")


# The backends: each reads its call, then runs a varlen kernel or one sdpa per segment.
def _allowed_mask(n: int, call: AttentionCall, device: torch.device) -> torch.Tensor | None:
    """bool [n, n] of the keys each query may see in one segment, or None for plain causal / full attention."""
    if call.sliding_window is None or n <= call.sliding_window:
        return None
    q_idx = torch.arange(n, device=device)[:, None]
    k_idx = torch.arange(n, device=device)[None, :]
    # transformers' window: key j is visible from query i when i - window < j <= i
    return (k_idx <= q_idx) & (k_idx > q_idx - call.sliding_window)


def _explicit_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, training: bool) -> torch.Tensor:
    """Attention of one segment written out, for soft-capping and sinks. q [1, Hq, n, D], k/v [1, Hq, n, D]."""
    n = q.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * call.scaling
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    allowed = _allowed_mask(n, call, q.device)
    if allowed is None and call.is_causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if call.sinks is not None:
        sink_logits = call.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(1, scores.shape[1], n, 1)
        logits = torch.cat([scores, sink_logits], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    else:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=call.dropout, training=training and call.dropout > 0)
    return torch.matmul(probs, v)


# A compiled decoder layer (parallel.compile) runs this eagerly between two graphs: the loop needs the segment bounds
# on the host, so dynamo would break the graph at the first `.item()` anyway; disabling it skips the failed trace.
@torch.compiler.disable(reason="per-segment loop over host-side segment bounds")
def sdpa_segments_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention per segment: SDPA with is_causal (a band mask under a sliding window), or the explicit softmax
    when the layer soft-caps logits or has sinks. Exact, any device, any dtype, forward and backward."""
    shard = kwargs.pop("context_shard", None)
    if shard is not None:
        return context_parallel_attention(module, query, key, value, attention_mask, shard, scaling, dropout, kwargs)
    call = read_call(SDPA_SEGMENTS, module, query, key, attention_mask, scaling, dropout, kwargs)
    num_groups = query.shape[1] // key.shape[1]
    explicit = call.softcap is not None or call.sinks is not None
    if explicit and num_groups > 1:
        key = key.repeat_interleave(num_groups, dim=1)
        value = value.repeat_interleave(num_groups, dim=1)
    bounds = call.bounds()
    if call.branches is not None:
        assert len(call.branches.masks) == len(bounds) - 1, "shared-prompt masks do not match the row's segments"
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    # One split per tensor, not a slice per segment: a slice's backward writes its gradient into a zero-filled
    # tensor of the whole row, once per segment (16 chats a row: 16 row-sized fills and copies per q, k, v and layer).
    outs = []
    for segment, (q, k, v) in enumerate(zip(*(t.split(sizes, dim=2) for t in (query, key, value)))):
        if explicit:
            outs.append(_explicit_segment(q, k, v, call, module.training))
            continue
        if call.branches is not None:  # a group of shared prompts: causal within its prompt and each response
            allowed = call.branches.masks[segment]
        else:
            allowed = _allowed_mask(sizes[segment], call, query.device)
        outs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=call.dropout,
                is_causal=call.is_causal and allowed is None,
                scale=call.scaling,
                enable_gqa=num_groups > 1,
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _check_context_call(module: torch.nn.Module, attention_mask, dropout: float, kwargs: dict[str, Any]) -> None:
    """Context parallelism serves plain causal attention (GQA included): anything else is refused, never ignored."""
    is_causal = kwargs.get("is_causal")
    features = (
        (attention_mask is not None, "an attention mask"),
        (not bool(getattr(module, "is_causal", True) if is_causal is None else is_causal), "non-causal attention"),
        (kwargs.get("sliding_window") is not None, "a sliding window"),
        (kwargs.get("softcap") is not None, "logit soft-capping"),
        (kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None, "attention sinks"),
        (bool(dropout) and module.training, "attention dropout"),
        (kwargs.get("prompt_branches") is not None, "shared prompts"),
        (kwargs.get("output_attentions"), "output_attentions=True"),
    )
    for present, feature in features:
        if present:
            raise refuse(SDPA_SEGMENTS, f"{feature} under context parallelism", "set parallel.cp=1 (docs/scaling.md)")


def context_parallel_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, shard: Any, scaling: float | None, dropout: float,
                               kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """This rank's queries `[1, Hq, L, D]` against the whole row's keys and values, segment by segment.

    `shard` (fsdptrain.distributed.context_parallel.ContextShard) all-gathers the keys and values of the CP group into
    the row's order (`gather`, differentiable) and holds the split (`split.pieces`: fsdptrain/data/context_split.py).
    A piece of q queries and k keys, causal aligned bottom-right, is square causal SDPA when k = q, and otherwise
    `_RectangleSquare`: the rectangle of the k - q earlier keys (no mask) and the causal square, merged by their
    log-sum-exp. No `[q, k]` mask exists (a mask sends the CPU kernel to `[heads, q, k]` scores) and no query is
    computed that is not this rank's (docs/performance.md)."""
    _check_context_call(module, attention_mask, dropout, kwargs)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    key_T, value_T = shard.gather(key), shard.gather(value)
    num_groups = query.shape[1] // key.shape[1]
    outs = []
    for piece in shard.split.pieces:
        q = query[:, :, piece.q_start:piece.q_end]
        k = key_T[:, :, piece.k_start:piece.k_end]
        v = value_T[:, :, piece.k_start:piece.k_end]
        if piece.num_keys == piece.num_queries:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=num_groups > 1))
        else:
            outs.append(_RectangleSquare.apply(q, k, v, scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


class _RectangleSquare(torch.autograd.Function):
    """Attention of n queries `[1, Hq, n, D]` on m > n keys `[1, Hkv, m, D]`, causal aligned bottom-right (query i
    sees keys j <= m - n + i), as ring attention computes a block: the rectangle (every query on the m - n earlier
    keys, no mask) and the square (the last n keys, causal), each with its log-sum-exp of the scaled scores, merged:

        lse = logaddexp(lse_rect, lse_square),   out = exp(lse_rect - lse) out_rect + exp(lse_square - lse) out_square

    Backward: attention's gradient is a sum over key blocks once the softmax's row statistics are the merged ones
    (P_ij = exp(s_ij - lse_i), delta_i = dO_i . O_i), so the backward of each part's kernel, handed the merged out and
    lse, gives that part's exact share: dq sums the two, dk and dv concatenate.

    Why a custom Function rather than autograd through two SDPA outputs: the merge weights need each part's lse as a
    differentiable function of q and k, and public SDPA returns none; computing it apart costs the `[Hq, n, m]`
    scores (or a blocked recompute with a backward of its own, a custom Function again). Here the kernels return the
    lse with the output, and autograd keeps only q, k, v (views of tensors alive anyway), the merged out and one fp32
    lse per query and head."""

    @staticmethod
    def forward(ctx, query, key, value, scale: float):
        split = key.shape[2] - query.shape[2]
        rect_out, rect_lse = _attend(query, key[:, :, :split], value[:, :, :split], causal=False, scale=scale)
        square_out, square_lse = _attend(query, key[:, :, split:], value[:, :, split:], causal=True, scale=scale)
        # in fp64, rounded once: the merge adds no error of its own to the kernels' (fp32 would add a few ulp)
        lse = torch.logaddexp(rect_lse.double(), square_lse.double())
        out = rect_out.double().mul_((rect_lse - lse).exp_().unsqueeze(-1))
        out = out.add_(square_out.double().mul_((square_lse - lse).exp_().unsqueeze(-1))).to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse.float())
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        split = key.shape[2] - query.shape[2]
        grad_out = grad_out.contiguous()
        rect = _attend_backward(grad_out, query, key[:, :, :split], value[:, :, :split], out, lse, causal=False,
                                scale=ctx.scale)
        square = _attend_backward(grad_out, query, key[:, :, split:], value[:, :, split:], out, lse, causal=True,
                                  scale=ctx.scale)
        return rect[0] + square[0], torch.cat([rect[1], square[1]], dim=2), torch.cat([rect[2], square[2]], dim=2), None


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out `[1, Hq, n, D]`, fp32 lse `[1, Hq, n]` of the scaled scores) of n queries on m keys (GQA not expanded);
    `causal`: n = m and query i sees keys j <= i. The CPU's fused flash kernel, else `_blocked_attend`."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
    return _blocked_attend(query, key, value, causal=causal, scale=scale)


def _attend_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_attend` with the softmax's row statistics `out`, `lse` (possibly those of a merge)."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)
    return _blocked_attend_backward(grad_out, query, key, value, out, lse, causal=causal, scale=scale)


_BLOCK = 256
"""Queries per block of `_blocked_attend`: its scores are `[Hq, _BLOCK, m]` fp32 at a time."""


def _blocked_scores(query_b: torch.Tensor, key: torch.Tensor, first: int, causal: bool, scale: float) -> torch.Tensor:
    """fp32 `[1, Hq, b, m]` scaled scores of the queries from `first` on (GQA expanded keys), -inf where masked."""
    scores = torch.matmul(query_b.float(), key.float().transpose(2, 3)) * scale
    if causal:
        rows = torch.arange(first, first + query_b.shape[2], device=scores.device)[:, None]
        scores = scores.masked_fill(torch.arange(key.shape[2], device=scores.device)[None, :] > rows, float("-inf"))
    return scores


def _blocked_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend` on any device: the queries `_BLOCK` at a time, each block's scores materialised in fp32."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    outs, lses = [], []
    for first in range(0, query.shape[2], _BLOCK):
        scores = _blocked_scores(query[:, :, first:first + _BLOCK], key, first, causal, scale)
        lse = scores.logsumexp(dim=-1)
        outs.append(torch.matmul((scores - lse.unsqueeze(-1)).exp(), value.float()).to(query.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _blocked_attend_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_attend_backward` on any device: with P = exp(s - lse) and delta = rowsum(dO * O),
    dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale dS K, dK = scale dS^T Q (then summed over each kv head's
    query heads)."""
    num_kv, groups = key.shape[1], query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1).float(), value.repeat_interleave(groups, dim=1).float()
    delta = (grad_out.float() * out.float()).sum(dim=-1)
    grad_query, grad_key, grad_value = [], torch.zeros_like(key), torch.zeros_like(value)
    for first in range(0, query.shape[2], _BLOCK):
        last = first + _BLOCK
        query_b, grad_out_b = query[:, :, first:last].float(), grad_out[:, :, first:last].float()
        probs = (_blocked_scores(query_b, key, first, causal, scale) - lse[:, :, first:last].unsqueeze(-1)).exp()
        grad_value += torch.matmul(probs.transpose(2, 3), grad_out_b)
        grad_scores = probs * (torch.matmul(grad_out_b, value.transpose(2, 3)) - delta[:, :, first:last].unsqueeze(-1))
        grad_query.append(torch.matmul(grad_scores, key) * scale)
        grad_key += torch.matmul(grad_scores.transpose(2, 3), query_b) * scale

    def per_kv_head(grad: torch.Tensor) -> torch.Tensor:
        return grad.unflatten(1, (num_kv, groups)).sum(dim=2).to(out.dtype)

    return torch.cat(grad_query, dim=2).to(query.dtype), per_kv_head(grad_key), per_kv_head(grad_value)


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen attention function (`flash_attn_varlen_func`, torch's `varlen_attn`, or a stand-in with the same
    signature) and the devices and activation dtypes it runs on. The backends find theirs through `flash_kernel`
    and `torch_varlen_kernel` only, so a test can install a CPU stand-in by replacing one of those attributes."""

    fn: Callable
    device_types: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


@functools.cache
def flash_kernel() -> VarlenKernel | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # a broken build (wrong CUDA/torch ABI) is "not available", not a crash at import
        logger.warning("flash_attn is installed but could not be imported", exc_info=True)
        return None
    return VarlenKernel(flash_attn_varlen_func)


@functools.cache
def torch_varlen_kernel() -> VarlenKernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenKernel(varlen_attn)


@functools.cache
def _parameters(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _check_kernel_input(call: AttentionCall, kernel: VarlenKernel, query: torch.Tensor, value: torch.Tensor) -> None:
    if query.device.type not in kernel.device_types:
        raise ValueError(
            f"{call.backend} runs on {'/'.join(kernel.device_types).upper()} only; these tensors are on "
            f"{query.device.type}. Use attn backend 'auto' or 'sdpa_segments'"
        )
    if query.dtype not in kernel.dtypes:
        raise ValueError(
            f"{call.backend} takes {'/'.join(str(d).removeprefix('torch.') for d in kernel.dtypes)} activations, "
            f"got {query.dtype}: train under bf16 mixed precision or use 'sdpa_segments' "
            f"(resolve_backend('auto', device, dtype) picks it for fp32)"
        )
    if value.shape[-1] != query.shape[-1]:
        raise refuse(call.backend, "a value head size different from the query's", "use 'sdpa_segments'")


def _row_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D], the varlen kernels' layout."""
    return x[0].transpose(0, 1).contiguous()


def flash_attn_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """flash-attention 2's `flash_attn_varlen_func` over the row's segments (GQA native, sliding window via
    `window_size`, soft-capping via `softcap` where the installed version takes it, dropout via `dropout_p`)."""
    call = read_call(FLASH_ATTN, module, query, key, attention_mask, scaling, dropout, kwargs)
    if call.sinks is not None:
        raise refuse(FLASH_ATTN, "attention sinks (s_aux)", "use 'sdpa_segments'")
    kernel = flash_kernel()
    if kernel is None:
        raise ValueError("attention backend 'flash_attn' needs the flash_attn package; install it or use 'auto'")
    _check_kernel_input(call, kernel, query, value)
    fn = kernel.fn
    options: dict[str, Any] = {"dropout_p": call.dropout, "softmax_scale": call.scaling, "causal": call.is_causal}
    if call.sliding_window is not None:
        if "window_size" not in _parameters(fn):
            raise refuse(FLASH_ATTN, "a sliding window with this flash_attn version", "upgrade flash_attn")
        # flash's window is inclusive on both ends: (window - 1) keys back plus the query's own
        options["window_size"] = (call.sliding_window - 1, 0)
    if call.softcap is not None:
        if "softcap" not in _parameters(fn):
            raise refuse(FLASH_ATTN, "logit soft-capping with this flash_attn version", "upgrade to flash_attn>=2.6")
        options["softcap"] = call.softcap
    if call.branches is not None:
        return _flash_shared_prompts(fn, query, key, value, call.branches, options), None
    cu = call.cu_seqlens.to(query.device)
    longest = call.longest()
    out_T = fn(_row_to_tokens(query), _row_to_tokens(key), _row_to_tokens(value), cu, cu, longest, longest, **options)
    return out_T.unsqueeze(0), None


def _flash_shared_prompts(fn: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          branches: PromptBranches, options: dict[str, Any]) -> torch.Tensor:
    """One varlen call over the entries of a shared-prompt row: the queries stay as they are in the row (each
    prompt once), the keys and values are gathered per entry (a response's: its prompt, then itself), and the kernel's
    causal mask, aligned bottom-right, lets a response's query r see its whole prompt and its own tokens up to r."""
    index_K = branches.kv_index_K.to(query.device)
    k_K = _row_to_tokens(key).index_select(0, index_K)
    v_K = _row_to_tokens(value).index_select(0, index_K)
    out_T = fn(_row_to_tokens(query), k_K, v_K, branches.cu_q.to(query.device), branches.cu_k.to(query.device),
               branches.max_q, branches.max_k, **options)
    return out_T.unsqueeze(0)


def torch_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """torch's `varlen_attn` over the row's segments (GQA via `enable_gqa`, sliding window via `window_size` where
    the installed torch takes it). Its kernel has no dropout, soft-capping or sinks: those are refused, and so is a
    non-default softmax scale where `varlen_attn` takes no `scale` (torch 2.9)."""
    call = read_call(TORCH_VARLEN, module, query, key, attention_mask, scaling, dropout, kwargs)
    if call.branches is not None:
        raise refuse(TORCH_VARLEN, "shared prompts", "use 'flash_attn' or 'sdpa_segments' (model.attn_backend)")
    if call.softcap is not None:
        raise refuse(TORCH_VARLEN, "logit soft-capping", "use 'flash_attn' or 'sdpa_segments'")
    if call.sinks is not None:
        raise refuse(TORCH_VARLEN, "attention sinks (s_aux)", "use 'sdpa_segments'")
    if call.dropout > 0:
        raise refuse(
            TORCH_VARLEN, f"attention dropout {call.dropout}", "set attention_dropout=0 or use 'sdpa_segments'"
        )
    kernel = torch_varlen_kernel()
    if kernel is None:
        raise ValueError(f"this torch ({torch.__version__}) has no torch.nn.attention.varlen; use 'auto'")
    _check_kernel_input(call, kernel, query, value)
    fn = kernel.fn
    params = _parameters(fn)
    options: dict[str, Any] = {}
    if "scale" in params:
        options["scale"] = call.scaling
    elif not math.isclose(call.scaling, query.shape[-1] ** -0.5, rel_tol=1e-6):
        # the first varlen_attn (torch 2.9) takes no scale: its kernel always uses 1/sqrt(head_dim)
        raise refuse(
            TORCH_VARLEN, f"softmax scale {call.scaling:g} with this torch", "use 'flash_attn' or 'sdpa_segments'"
        )
    if "window_size" in params:  # torch >= 2.11: causality and windows are both a window_size
        left = call.sliding_window - 1 if call.sliding_window is not None else -1
        options["window_size"] = (left, 0) if call.is_causal else (-1, -1)
    else:
        if call.sliding_window is not None:
            raise refuse(TORCH_VARLEN, "a sliding window with this torch", "use 'flash_attn' or 'sdpa_segments'")
        options["is_causal"] = call.is_causal
    q, k, v = _row_to_tokens(query), _row_to_tokens(key), _row_to_tokens(value)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = call.cu_seqlens.to(query.device)
    longest = call.longest()
    out_T = fn(q, k, v, cu, cu, longest, longest, **options)
    return out_T.unsqueeze(0), None


def no_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """The mask builder transformers calls for our backends: segments replace masks, so this returns None; but a
    2-D padding mask with a padded position is refused. (Without a registered mask builder transformers drops a
    custom implementation's padding mask silently, and the padding would be attended.)"""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "packed attention backends take no padding mask: pack the sequences (fsdptrain.data.packing) and pass "
            "attention_mask=None, or run padded batches and generation on sdpa"
        )
    return None


BACKEND_FUNCTIONS = {
    FLASH_ATTN: flash_attn_attention,
    TORCH_VARLEN: torch_varlen_attention,
    SDPA_SEGMENTS: sdpa_segments_attention,
}
