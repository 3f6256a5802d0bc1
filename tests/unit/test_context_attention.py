"""Context parallelism's attention of a piece whose queries start after their segment's first key
(fsdptrain/model/attention_backends.py, `_RectangleSquare`): the rectangle and the causal square merged by their
log-sum-exp equal bottom-right causal attention written out in fp64, forward and backward; the blocked kernels (any
device) equal the CPU's fused ones, also when handed a merge's row statistics."""

from __future__ import annotations

import pytest
import torch

from fsdptrain.model.attention_backends import (
    _attend,
    _attend_backward,
    _blocked_attend,
    _blocked_attend_backward,
    _RectangleSquare,
)


def _inputs(num_heads: int, num_kv: int, n: int, m: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, length, 8, generator=gen, dtype=dtype)
            for heads, length in ((num_heads, n), (num_kv, m), (num_kv, m))]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 against fp32, up to summation order: within 1e-6 of the values' scale (measured <= 7e-7 of it)."""
    return (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())


def _reference(query, key, value, scale):
    """Bottom-right causal attention, the softmax written out: query i sees keys j <= m - n + i."""
    n, m, groups = query.shape[2], key.shape[2], query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * scale
    hidden = torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n)
    return scores.masked_fill(hidden, float("-inf")).softmax(dim=-1) @ value


@pytest.mark.parametrize("num_heads, num_kv, n, m", [(2, 2, 5, 12), (4, 2, 3, 4), (4, 1, 7, 9)])
def test_rectangle_square_equals_bottom_right_causal_attention(num_heads, num_kv, n, m):
    scale = 0.37
    inputs = [x.requires_grad_() for x in _inputs(num_heads, num_kv, n, m)]
    wide = [x.detach().double().requires_grad_() for x in inputs]
    grad_out = torch.randn(1, num_heads, n, 8, generator=torch.Generator().manual_seed(1))

    out = _RectangleSquare.apply(*inputs, scale)
    want = _reference(*wide, scale)
    assert (out.double() - want).abs().max() <= 1e-6
    out.backward(grad_out)
    want.backward(grad_out.double())
    for got, ref in zip(inputs, wide):
        assert (got.grad.double() - ref.grad).abs().max() <= 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_kernels_equal_the_fused_ones(causal):
    n = 300  # more than one block of queries
    query, key, value = _inputs(4, 2, n, n if causal else 350, seed=2)
    scale = 0.29
    out, lse = _attend(query, key, value, causal=causal, scale=scale)
    blocked_out, blocked_lse = _blocked_attend(query, key, value, causal=causal, scale=scale)
    assert _close(blocked_out, out) and _close(blocked_lse, lse)
    # a merge's row statistics: the softmax of these keys together with others (lse raised, out another's)
    merged_out, merged_lse = 0.5 * out, lse + 0.7
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    fused = _attend_backward(grad_out, query, key, value, merged_out, merged_lse, causal=causal, scale=scale)
    blocked = _blocked_attend_backward(grad_out, query, key, value, merged_out, merged_lse, causal=causal, scale=scale)
    for got, want in zip(blocked, fused):
        assert got.shape == want.shape and _close(got, want)
