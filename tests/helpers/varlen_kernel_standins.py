"""CPU stand-ins for the two varlen attention kernels, written from their documentation only.

- `flash_attn_varlen_func`: flash-attention 2's docstring (flash_attn/flash_attn_interface.py).
- `varlen_attn`: torch 2.13's `torch.nn.attention.varlen.varlen_attn` docstring and its Python wrapper (which
  turns `window_size == (-1, 0)` into `is_causal` and hands `window_size` to flash-attention's kernel).

Each has the real function's signature (the backends read it with `inspect.signature`) and computes attention one
segment and one head at a time from the documented mask, in float64: no call into fsdptrain.model.attention_switch, no SDPA.
The documented mask, for a segment of `n_q` queries and `n_k` keys, is aligned to the bottom-right corner:
query i sees key j when `j <= i + n_k - n_q` (causal) and `i + n_k - n_q - left <= j <= i + n_k - n_q + right`
(window, both ends inclusive, -1 = unbounded). A query that sees no key outputs zeros. With GQA, query head h
reads kv head `h // (nheads / nheads_k)` ("head 0, 1, 2 of Q attend to head 0 of K, V").

`misread` builds a deliberately wrong kernel for the negative tests: "window_off_by_one" (the left bound read as
exclusive), "heads_first" (q/k/v read as `[nheads, total, headdim]`), "kv_swapped", "gqa_tiled" (query head h on
kv head `h % nheads_k`).
"""

from __future__ import annotations

import math

import torch

from fsdptrain.model.attention_backends import VarlenKernel

MISREADS = ("window_off_by_one", "heads_first", "kv_swapped", "gqa_tiled")


def _visible(n_q: int, n_k: int, causal: bool, window: tuple[int, int], misread: str | None) -> torch.Tensor:
    """bool [n_q, n_k] from the documented bottom-right-aligned causal mask and inclusive window."""
    shift = n_k - n_q
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    seen = torch.ones(n_q, n_k, dtype=torch.bool)
    left, right = window
    if left >= 0:
        seen &= j > i + shift - left if misread == "window_off_by_one" else j >= i + shift - left
    if right >= 0:
        seen &= j <= i + shift + right
    if causal:
        seen &= j <= i + shift
    return seen


def _check_layout(q, k, v, cu_q, cu_k, max_q, max_k):
    assert q.dim() == k.dim() == v.dim() == 3, "q, k, v are [total, nheads, headdim]"
    assert k.shape == v.shape and q.shape[-1] == k.shape[-1], (q.shape, k.shape, v.shape)
    assert q.shape[1] % k.shape[1] == 0, "nheads must be divisible by nheads_k"
    for cu, total, longest in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device, (cu.dtype, cu.device)
        assert int(cu[0]) == 0 and int(cu[-1]) == total, f"cu_seqlens {cu.tolist()} for {total} tokens"
        # the real kernel sizes its grid from max_seqlen: a longer segment would be cut off, not an error
        assert isinstance(longest, int) and longest >= int(cu.diff().max()), (longest, cu.tolist())


def _attend(q, k, v, cu_q, cu_k, *, scale, causal, window, softcap=0.0, alibi_slopes=None, misread=None):
    """[total_q, nheads, headdim] in q's dtype: a loop over segments and heads, float64 inside."""
    if misread == "heads_first":  # the same memory read as [nheads, total, headdim]
        q, k, v = (x.reshape(x.shape[1], x.shape[0], x.shape[2]).transpose(0, 1) for x in (q, k, v))
    if misread == "kv_swapped":
        k, v = v, k
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    rows = []
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        seen = _visible(q1 - q0, k1 - k0, causal, window, misread)
        heads = []
        for h in range(num_heads):
            kv_head = h % num_kv_heads if misread == "gqa_tiled" else h // group
            qh = q[q0:q1, h].double()
            kh, vh = k[k0:k1, kv_head].double(), v[k0:k1, kv_head].double()
            scores = qh @ kh.T * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi_slopes is not None:
                i = torch.arange(q1 - q0)[:, None]
                j = torch.arange(k1 - k0)[None, :]
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[s, h]
                scores = scores - slope.double() * (i + (k1 - k0) - (q1 - q0) - j).abs()
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            probs = torch.nan_to_num(probs, nan=0.0)  # a query that sees no key outputs zeros
            heads.append(probs @ vh)
        rows.append(torch.stack(heads, dim=1))
    return torch.cat(rows, dim=0).to(q.dtype)


def make_flash_attn_varlen_func(misread: str | None = None):
    """A stand-in for `flash_attn.flash_attn_varlen_func` (flash-attention >= 2.6: `softcap`, `block_table`)."""
    assert misread is None or misread in MISREADS

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        _check_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert len(window_size) == 2 and all(isinstance(w, int) for w in window_size), window_size
        if dropout_p != 0.0 or return_attn_probs or block_table is not None:
            raise NotImplementedError("the stand-in has no dropout, attention probabilities or paged KV")
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return _attend(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal, window=tuple(window_size),
            softcap=softcap, alibi_slopes=alibi_slopes, misread=misread,
        )

    return flash_attn_varlen_func


def make_varlen_attn(misread: str | None = None):
    """A stand-in for torch 2.13's `torch.nn.attention.varlen.varlen_attn`."""
    assert misread is None or misread in MISREADS

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        # the wrapper's own checks, as in torch's source
        if not enable_gqa and query.shape[1] != key.shape[1]:
            raise ValueError("Expect query and key/value to have the same number of heads; set enable_gqa=True")
        if enable_gqa and query.shape[1] % key.shape[1] != 0:
            raise ValueError("Expect number of query heads to be a multiple of kv heads for GQA")
        if len(window_size) != 2:
            raise ValueError(f"window_size must have length 2, got {len(window_size)}")
        if return_aux is not None or seqused_k is not None or block_table is not None:
            raise NotImplementedError("the stand-in has no lse output, seqused_k or paged KV")
        _check_layout(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        is_causal = window_size == (-1, 0)  # what the wrapper passes to the kernel beside the window itself
        scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        return _attend(
            query, key, value, cu_seq_q, cu_seq_k, scale=scale, causal=is_causal, window=tuple(window_size),
            misread=misread,
        )

    return varlen_attn


def make_varlen_attn_torch_2_9():
    """A stand-in for the first `varlen_attn` (torch 2.9): causality as a flag, no window, no `scale` (the kernel
    uses 1/sqrt(headdim)) and one head count for q, k and v."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert query.shape[1] == key.shape[1], "this varlen_attn takes no GQA: key (T_k, H, D)"
        if return_aux is not None:
            raise NotImplementedError("the stand-in has no lse output")
        _check_layout(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        return _attend(
            query, key, value, cu_seq_q, cu_seq_k, scale=1.0 / math.sqrt(query.shape[-1]), causal=is_causal,
            window=(-1, -1),
        )

    return varlen_attn


def cpu_kernel(fn) -> VarlenKernel:
    """The stand-in declared as a CPU kernel for fp32/fp64 activations (the real ones: CUDA, fp16/bf16)."""
    return VarlenKernel(fn, device_types=("cpu",), dtypes=(torch.float32, torch.float64))
