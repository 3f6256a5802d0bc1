"""The packed attention backends called directly (fsdptrain/model/attention_switch.py), against a dense masked reference.

The reference builds the full [T, T] score matrix and masks it by segment, causality and window: an independent,
slow formulation of what the per-segment backend must compute.
"""

import math

import pytest
import torch
from torch import nn

from fsdptrain.data.packing import pack_sequences
from fsdptrain.model import attention_switch
from fsdptrain.model.attention_backends import (
    BACKENDS,
    flash_attn_attention,
    sdpa_segments_attention,
    torch_varlen_attention,
)
from fsdptrain.model.attention_switch import available_backends, resolve_backend

SEGMENTS = [5, 9, 3, 2]  # three sequences and a 2-token padding tail
TOTAL = sum(SEGMENTS)


class _Layer(nn.Module):
    """Stands in for an HF attention module: the backends read `is_causal` and `training` from it."""

    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _position_ids(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).view(1, -1)


def _qkv(num_heads=4, num_kv_heads=4, head_dim=8, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_heads, TOTAL, head_dim, generator=gen)
    k = torch.randn(1, num_kv_heads, TOTAL, head_dim, generator=gen)
    v = torch.randn(1, num_kv_heads, TOTAL, head_dim, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def _dense_reference(q, k, v, lengths, *, causal=True, window=None, softcap=None, sinks=None, scale=None):
    """[1, T, H, D] from the full masked score matrix (float64)."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(TOTAL)[:, None], torch.arange(TOTAL)[None, :]
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= j > i - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().view(1, -1, 1, 1).expand(1, scores.shape[1], TOTAL, 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ v).transpose(1, 2)


CASES = {
    "causal": {},
    "gqa": {"num_kv_heads": 2},
    "window": {"window": 3},
    "window_gqa": {"window": 4, "num_kv_heads": 1},
    "softcap": {"softcap": 0.7},
    "softcap_window_gqa": {"softcap": 0.7, "window": 3, "num_kv_heads": 2},
    "sinks": {"sinks": True},
    "non_causal": {"causal": False},
    "scale": {"scale": 0.05},
}


@pytest.mark.parametrize("case", CASES)
def test_sdpa_segments_matches_dense_reference(case):
    opts = dict(CASES[case])
    q, k, v = _qkv(num_kv_heads=opts.pop("num_kv_heads", 4))
    sinks = torch.linspace(-1.0, 2.0, 4) if opts.pop("sinks", False) else None
    causal, window, softcap, scale = (opts.get(n) for n in ("causal", "window", "softcap", "scale"))
    causal = True if causal is None else causal
    kwargs = {"sliding_window": window, "softcap": softcap, "s_aux": sinks, "is_causal": causal}

    out_cu, weights = sdpa_segments_attention(
        _Layer(), q, k, v, None, scaling=scale, cu_seq_lens_q=_cu(SEGMENTS), cu_seq_lens_k=_cu(SEGMENTS), **kwargs
    )
    out_pos, _ = sdpa_segments_attention(
        _Layer(), q, k, v, None, scaling=scale, position_ids=_position_ids(SEGMENTS), **kwargs
    )
    assert weights is None
    expected = _dense_reference(
        q, k, v, SEGMENTS, causal=causal, window=window, softcap=softcap, sinks=sinks, scale=scale
    )
    assert out_cu.shape == (1, TOTAL, 4, 8)
    assert (out_cu.double() - expected).abs().max() <= 1e-6
    assert torch.equal(out_cu, out_pos), "segments from cu_seq_lens or from position_ids: the same"

    # the feature under test changes the result, so the comparison above can fail
    if window is not None or softcap is not None or sinks is not None or not causal:
        plain = _dense_reference(q, k, v, SEGMENTS, scale=scale)
        assert (plain - expected).abs().max() > 1e-3


def test_sdpa_segments_backward_matches_dense_reference():
    q, k, v = (x.requires_grad_() for x in _qkv(num_kv_heads=2, seed=1))
    out, _ = sdpa_segments_attention(_Layer(), q, k, v, None, position_ids=_position_ids(SEGMENTS), sliding_window=4)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _dense_reference(q2, k2, v2, SEGMENTS, window=4)
    ref_grads = torch.autograd.grad((ref * weight.double()).sum(), (q2, k2, v2))
    for g, r in zip(grads, ref_grads):
        # gradients reach O(5) here: fp32 rounding, relative to the largest entry
        assert (g.double() - r).abs().max() <= 1e-6 * r.abs().max()


def _backward_nodes(tensor: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_sdpa_segments_backward_splits_the_row_once():
    """q, k and v are split into segments once each: a per-segment slice's backward zero-fills and copies a tensor of
    the whole row once per segment (docs/sft-vs-trl.md, the profile of `fsdptrain sft`)."""
    q, k, v = (x.requires_grad_() for x in _qkv(num_kv_heads=2, seed=1))
    out, _ = sdpa_segments_attention(_Layer(), q, k, v, None, position_ids=_position_ids(SEGMENTS))
    nodes = _backward_nodes(out)
    assert "SliceBackward0" not in nodes, nodes
    assert nodes.count("SplitWithSizesBackward0") == 3, nodes


def test_dropout_is_applied_not_ignored():
    q, k, v = _qkv()
    layer = _Layer().train()
    torch.manual_seed(0)
    dropped, _ = sdpa_segments_attention(layer, q, k, v, None, dropout=0.5, position_ids=_position_ids(SEGMENTS))
    plain, _ = sdpa_segments_attention(layer, q, k, v, None, dropout=0.0, position_ids=_position_ids(SEGMENTS))
    assert (dropped - plain).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------------------
# Refusals: every one names the problem
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (torch_varlen_attention, {"softcap": 1.0}, "cannot honour logit soft-capping"),
        (torch_varlen_attention, {"s_aux": torch.zeros(4)}, "cannot honour attention sinks"),
        (torch_varlen_attention, {"dropout": 0.1}, "cannot honour attention dropout 0.1"),
        (torch_varlen_attention, {}, "CUDA only|no torch.nn.attention.varlen"),
        (flash_attn_attention, {"s_aux": torch.zeros(4)}, "cannot honour attention sinks"),
        (flash_attn_attention, {}, "needs the flash_attn package|CUDA only"),
        (sdpa_segments_attention, {"position_bias": torch.zeros(1)}, "cannot honour `position_bias`"),
        (sdpa_segments_attention, {"output_attentions": True}, "output_attentions"),
        (sdpa_segments_attention, {"is_causal": False, "sliding_window": 3}, "sliding window on non-causal"),
    ],
)
def test_unsupported_features_are_refused(fn, kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        fn(_Layer(), q, k, v, None, position_ids=_position_ids(SEGMENTS), **kwargs)


def test_bad_segment_information_is_refused():
    q, k, v = _qkv()
    layer = _Layer()
    with pytest.raises(ValueError, match="attention mask"):
        sdpa_segments_attention(layer, q, k, v, torch.ones(1, 1, TOTAL, TOTAL, dtype=torch.bool))
    with pytest.raises(ValueError, match="training forwards only"):
        sdpa_segments_attention(layer, q[:, :, :1], k, v, None, position_ids=torch.tensor([[TOTAL]]))
    with pytest.raises(ValueError, match="one packed row"):
        sdpa_segments_attention(layer, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v, None)
    with pytest.raises(ValueError, match="no segments given"):
        sdpa_segments_attention(layer, q, k, v, None)
    with pytest.raises(ValueError, match="must start at 0"):
        sdpa_segments_attention(layer, q, k, v, None, position_ids=_position_ids(SEGMENTS) + 1)
    # left padding (positions 1 1 0 1 2 ...) is not a packed row
    odd_positions = _position_ids(SEGMENTS).clone()
    odd_positions[0, 3] = 7
    with pytest.raises(ValueError, match="count up by one"):
        sdpa_segments_attention(layer, q, k, v, None, position_ids=odd_positions)
    short_cu = _cu(SEGMENTS[:-1])  # forgets the padding tail
    with pytest.raises(ValueError, match="from 0 to the row length 19"):
        sdpa_segments_attention(layer, q, k, v, None, cu_seq_lens_q=short_cu, cu_seq_lens_k=short_cu)
    with pytest.raises(ValueError, match="same cu_seq_lens_q and _k"):
        sdpa_segments_attention(layer, q, k, v, None, cu_seq_lens_q=_cu(SEGMENTS), cu_seq_lens_k=_cu([TOTAL]))


# --------------------------------------------------------------------------------------------------------------
# Choosing a backend
# --------------------------------------------------------------------------------------------------------------


def test_backends_are_registered_by_an_explicit_call_not_by_import():
    import subprocess
    import sys

    code = (
        "from transformers import AttentionInterface\n"
        "import fsdptrain.model.attention_switch as attention_switch\n"
        "names = ('flash_attn', 'torch_varlen', 'sdpa_segments')\n"
        "print([n in AttentionInterface() for n in names])\n"
        "attention_switch.register_backends()\n"
        "print([n in AttentionInterface() for n in names])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["[False, False, False]", "[True, True, True]"]
    assert set(BACKENDS) == {"flash_attn", "torch_varlen", "sdpa_segments"}


def test_resolve_backend_on_cpu():
    assert available_backends("cpu") == ["sdpa_segments"]
    assert resolve_backend("auto", "cpu") == "sdpa_segments"
    assert resolve_backend("sdpa_segments", torch.device("cpu"), torch.float32) == "sdpa_segments"
    with pytest.raises(ValueError, match=r"'flash_attn' is not available on cpu; available here: sdpa_segments"):
        resolve_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match=r"'torch_varlen' is not available on cpu.*available here: sdpa_segments"):
        resolve_backend("torch_varlen", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="unknown packed attention backend 'flash'"):
        resolve_backend("flash", "cpu")


def test_packed_model_inputs_carry_segments_and_no_cache():
    packed = pack_sequences([[1, 2], [3]], [[4], [5, 6]], pad_to=8)
    inputs = attention_switch.packed_model_inputs(packed)
    assert inputs["use_cache"] is False and inputs["attention_mask"] is None
    assert inputs["input_ids"] is packed.input_ids and inputs["position_ids"] is packed.position_ids
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 6, 8] and inputs["cu_seq_lens_k"] is inputs["cu_seq_lens_q"]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 3


# --------------------------------------------------------------------------------------------------------------
# GPU kernels against the exact fallback (skipped where there is no CUDA device)
# --------------------------------------------------------------------------------------------------------------

_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("opts", [{}, {"num_kv_heads": 2}, {"window": 4, "num_kv_heads": 2}], ids=["mha", "gqa", "swa"])
def test_gpu_backend_matches_sdpa_segments(backend, opts):
    if not _CUDA:
        pytest.skip("needs a CUDA device")
    if backend not in available_backends("cuda", torch.bfloat16):
        pytest.skip(f"{backend} is not available on this GPU / install")
    fn = {"flash_attn": flash_attn_attention, "torch_varlen": torch_varlen_attention}[backend]
    opts = dict(opts)
    q, k, v = (x.requires_grad_() for x in _qkv(num_kv_heads=opts.pop("num_kv_heads", 4), head_dim=64,
                                                 dtype=torch.bfloat16, device="cuda"))
    cu = _cu(SEGMENTS).cuda()
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(SEGMENTS), "max_length_k": max(SEGMENTS),
              "sliding_window": opts.get("window")}
    out, _ = fn(_Layer(), q, k, v, None, **kwargs)
    ref, _ = sdpa_segments_attention(_Layer(), q, k, v, None, **kwargs)
    assert (out.float() - ref.float()).abs().max() <= 2e-2
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r.float()).abs().max() <= 5e-2
