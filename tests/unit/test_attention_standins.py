"""The GPU backends' own code (fsdptrain/model/attention_switch.py: `flash_attn`, `torch_varlen`) run on the CPU against
stand-in kernels written from the kernels' documentation (tests/helpers/varlen_kernel_standins.py).

What this checks: the packing of q/k/v into the varlen layout, cu_seqlens / max_seqlen, the window conversion,
soft-capping, GQA, the output layout and the refusals, each against `sdpa_segments` (itself checked against a
dense reference in test_attention.py). What it cannot check: the real kernels' numerics, backward and dropout
(docs/attention-backends.md, "Checking the GPU backends on a CPU"). The negative tests feed deliberately misread
kernels and assert the comparison fails, so the equalities here can fail.
"""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.masking_utils import sliding_window_causal_mask_function

from fsdptrain.data.packing import pack_sequences
from fsdptrain.model import attention_backends, attention_switch
from fsdptrain.model.attention_backends import flash_attn_attention, sdpa_segments_attention, torch_varlen_attention
from fsdptrain.model.attention_switch import packed_attention, packed_model_inputs, resolve_backend
from tests.helpers import varlen_kernel_standins
from tests.helpers.attention_call_counts import call_counts, reset_call_counts
from tests.helpers.varlen_kernel_standins import (
    cpu_kernel,
    make_flash_attn_varlen_func,
    make_varlen_attn,
    make_varlen_attn_torch_2_9,
)
from tests.unit.test_attention import _cu, _Layer

BACKENDS = {"flash_attn": flash_attn_attention, "torch_varlen": torch_varlen_attention}
_KERNEL_ATTR = {"flash_attn": "flash_kernel", "torch_varlen": "torch_varlen_kernel"}
_MAKERS = {"flash_attn": make_flash_attn_varlen_func, "torch_varlen": make_varlen_attn}
TOL = 1e-5


def _install(monkeypatch, backend, fn):
    """Make `backend` find `fn` as its kernel, declared as a CPU fp32/fp64 kernel."""
    kernel = cpu_kernel(fn)
    monkeypatch.setattr(attention_backends, _KERNEL_ATTR[backend], lambda: kernel)


@pytest.fixture(params=list(BACKENDS))
def backend(request, monkeypatch):
    _install(monkeypatch, request.param, _MAKERS[request.param]())
    return request.param


def _qkv(total, num_heads=4, num_kv_heads=4, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, num_heads, total, head_dim, generator=gen),
        torch.randn(1, num_kv_heads, total, head_dim, generator=gen),
        torch.randn(1, num_kv_heads, total, head_dim, generator=gen),
    )


def _kwargs(lengths, segments_from, **features):
    if segments_from == "position_ids":
        segments = {"position_ids": torch.cat([torch.arange(n) for n in lengths]).view(1, -1)}
    else:
        cu = _cu(lengths)
        longest = max(lengths)
        segments = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return {**segments, **{k: v for k, v in features.items() if v is not None}}


def _max_diff(backend, lengths, *, num_kv_heads=4, segments_from="cu_seq_lens", scaling=None, is_causal=True,
              sliding_window=None, softcap=None, seed=0):
    """max |backend - sdpa_segments| on one call, after checking the backend (and not sdpa) served it."""
    q, k, v = _qkv(sum(lengths), num_kv_heads=num_kv_heads, seed=seed)
    kwargs = _kwargs(lengths, segments_from, sliding_window=sliding_window, softcap=softcap, is_causal=is_causal)
    out, weights = BACKENDS[backend](_Layer(), q, k, v, None, scaling=scaling, **kwargs)
    ref, _ = sdpa_segments_attention(_Layer(), q, k, v, None, scaling=scaling, **kwargs)
    assert weights is None and out.shape == ref.shape == (1, sum(lengths), 4, 8) and out.dtype == q.dtype
    return (out - ref).abs().max().item()


def _assert_equal_to_sdpa_segments(backend, lengths, **options):
    diff = _max_diff(backend, lengths, **options)
    assert diff <= TOL, f"{backend} differs from sdpa_segments by {diff:.3g}"


# --------------------------------------------------------------------------------------------------------------
# The stand-ins follow the documentation (checked on its own worked examples, before anything is compared)
# --------------------------------------------------------------------------------------------------------------


def test_standin_masks_match_the_documented_examples():
    visible = varlen_kernel_standins._visible
    # flash_attn_varlen_func's docstring: causal is aligned to the bottom-right corner
    assert visible(2, 5, True, (-1, -1), None).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert visible(5, 2, True, (-1, -1), None).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # window (left, right) is inclusive: query i sees keys i - left .. i + right
    assert visible(4, 4, False, (1, 0), None).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert visible(3, 3, False, (0, 1), None).int().tolist() == [[1, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert visible(3, 3, False, (-1, -1), None).all()
    # "If the row of the mask is all zero, the output will be zero"
    q, k, v = torch.randn(5, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    out = make_flash_attn_varlen_func()(q, k, v, _cu([5]), _cu([2]), 5, 2, causal=True)
    assert torch.equal(out[:3], torch.zeros(3, 1, 4)) and out[3:].abs().sum() > 0


def test_standins_have_the_real_signatures():
    import inspect

    flash_params = list(inspect.signature(make_flash_attn_varlen_func()).parameters)
    assert flash_params == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
        "causal", "window_size", "softcap", "alibi_slopes", "deterministic", "return_attn_probs", "block_table",
    ]
    from torch.nn.attention.varlen import varlen_attn

    real, standin = inspect.signature(varlen_attn), inspect.signature(make_varlen_attn())
    assert [(p.name, p.kind, p.default) for p in standin.parameters.values()] == [
        (p.name, p.kind, p.default) for p in real.parameters.values()
    ]


def test_standin_checks_max_seqlen_and_cu_seqlens_dtype():
    fn = make_flash_attn_varlen_func()
    q = torch.randn(6, 2, 4)
    with pytest.raises(AssertionError):
        fn(q, q, q, _cu([2, 4]), _cu([2, 4]), 3, 3, causal=True)  # max_seqlen shorter than a segment
    with pytest.raises(AssertionError):
        fn(q, q, q, _cu([2, 4]).long(), _cu([2, 4]).long(), 4, 4, causal=True)  # int64 cu_seqlens


# --------------------------------------------------------------------------------------------------------------
# Each backend equals sdpa_segments
# --------------------------------------------------------------------------------------------------------------

LAYOUTS = {
    "mixed_with_tail": [5, 9, 3, 2],
    "length_one_segments": [1, 7, 1, 1, 4],
    "one_token": [1],
    "one_segment": [12],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("segments_from", ["cu_seq_lens", "position_ids"])
def test_segment_layouts(backend, layout, segments_from):
    _assert_equal_to_sdpa_segments(backend, LAYOUTS[layout], segments_from=segments_from)


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_gqa(backend, num_kv_heads):
    _assert_equal_to_sdpa_segments(backend, LAYOUTS["mixed_with_tail"], num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("options", [{"is_causal": False}, {"scaling": 0.05}], ids=["non_causal", "scale"])
def test_causality_and_scale(backend, options):
    _assert_equal_to_sdpa_segments(backend, LAYOUTS["mixed_with_tail"], **options)


@pytest.mark.parametrize("window", [1, 2, 3, 5, 9, 20])
def test_sliding_window(backend, window):
    """Windows shorter than, equal to and longer than the segments (9 is the longest: no effect at 9 and 20)."""
    _assert_equal_to_sdpa_segments(backend, LAYOUTS["mixed_with_tail"], sliding_window=window, num_kv_heads=2)


@pytest.mark.parametrize("window", [1, 3, 4])
def test_sliding_window_boundary_is_transformers_convention(backend, window):
    """With one-hot values (v[j] = e_j) the output row of query i is its attention weights: the keys it sees
    must be exactly those transformers' own sliding-window mask allows (`i - window < j <= i`: `window` keys,
    the query's own included), segment by segment."""
    lengths = [6, 2, 5]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, total, total, generator=gen), torch.randn(1, 1, total, total, generator=gen)
    v = torch.eye(total).view(1, 1, total, total)
    out, _ = BACKENDS[backend](_Layer(), q, k, v, None, sliding_window=window, **_kwargs(lengths, "cu_seq_lens"))
    seen = out[0, :, 0] > 0  # [query, key]
    allowed = sliding_window_causal_mask_function(window)
    start = 0
    for n in lengths:
        for i in range(n):
            for j in range(total):
                expected = start <= j < start + n and bool(allowed(*map(torch.tensor, (0, 0, i, j - start))))
                assert bool(seen[start + i, j]) == expected, f"query {start + i}, key {j}"
        start += n


def test_softcap_flash_attn(monkeypatch):
    _install(monkeypatch, "flash_attn", make_flash_attn_varlen_func())
    for opts in ({}, {"num_kv_heads": 2, "sliding_window": 3}):
        _assert_equal_to_sdpa_segments("flash_attn", LAYOUTS["length_one_segments"], softcap=0.7, **opts)
    # the cap matters at these scores, so a backend that dropped it would fail the comparison
    q, k, v = _qkv(14)
    kwargs = _kwargs([5, 9], "cu_seq_lens")
    capped, _ = flash_attn_attention(_Layer(), q, k, v, None, softcap=0.7, **kwargs)
    plain, _ = flash_attn_attention(_Layer(), q, k, v, None, **kwargs)
    assert (capped - plain).abs().max() > 1e-2


def test_backward_equals_sdpa_segments(backend):
    lengths = LAYOUTS["mixed_with_tail"]
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lengths), num_kv_heads=2, seed=1))
    kwargs = _kwargs(lengths, "cu_seq_lens", sliding_window=4)
    weight = torch.randn(1, sum(lengths), 4, 8, generator=torch.Generator().manual_seed(2))
    out, _ = BACKENDS[backend](_Layer(), q, k, v, None, **kwargs)
    ref, _ = sdpa_segments_attention(_Layer(), q, k, v, None, **kwargs)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= TOL * max(1.0, r.abs().max().item())


# --------------------------------------------------------------------------------------------------------------
# Refusals with a kernel present
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"softcap": 0.7}, "cannot honour logit soft-capping"),
        ({"dropout": 0.1}, "cannot honour attention dropout 0.1"),
        ({"s_aux": torch.zeros(4)}, "cannot honour attention sinks"),
    ],
)
def test_torch_varlen_refuses_what_its_kernel_lacks(monkeypatch, kwargs, match):
    calls = []
    _install(monkeypatch, "torch_varlen", lambda *a, **k: calls.append(1))
    q, k, v = _qkv(19)
    with pytest.raises(ValueError, match=match):
        torch_varlen_attention(_Layer(), q, k, v, None, **_kwargs([5, 9, 3, 2], "cu_seq_lens"), **kwargs)
    assert calls == [], "a refused call never reaches the kernel"


def test_older_kernels_refuse_features_their_signature_lacks(monkeypatch):
    """flash_attn < 2.6 has no `softcap`; the first torch varlen_attn (2.9) has no window, no scale and no GQA."""

    def flash_2_5(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                  softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                  return_attn_probs=False):
        return make_flash_attn_varlen_func()(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             dropout_p, softmax_scale, causal, window_size)

    _install(monkeypatch, "flash_attn", flash_2_5)
    _assert_equal_to_sdpa_segments("flash_attn", [5, 9, 3, 2], sliding_window=3, num_kv_heads=2)
    q, k, v = _qkv(19)
    with pytest.raises(ValueError, match=r"soft-capping with this flash_attn version.*flash_attn>=2.6"):
        flash_attn_attention(_Layer(), q, k, v, None, softcap=0.7, **_kwargs([5, 9, 3, 2], "cu_seq_lens"))

    _install(monkeypatch, "torch_varlen", make_varlen_attn_torch_2_9())
    for options in ({}, {"num_kv_heads": 2}, {"is_causal": False}):  # GQA: the backend repeats k/v itself
        _assert_equal_to_sdpa_segments("torch_varlen", [5, 9, 3, 2], **options)
    with pytest.raises(ValueError, match="cannot honour a sliding window with this torch"):
        torch_varlen_attention(_Layer(), q, k, v, None, sliding_window=3, **_kwargs([5, 9, 3, 2], "cu_seq_lens"))
    with pytest.raises(ValueError, match="cannot honour softmax scale 0.05 with this torch"):
        torch_varlen_attention(_Layer(), q, k, v, None, scaling=0.05, **_kwargs([5, 9, 3, 2], "cu_seq_lens"))


def test_the_real_kernels_stay_cuda_half_only(monkeypatch):
    """The stand-in is declared a CPU fp32 kernel; the real ones are not: the device/dtype guard reads the
    kernel's own declaration, so a real kernel still refuses CPU tensors and fp32 before it is called."""
    calls = []
    monkeypatch.setattr(attention_backends, "flash_kernel", lambda: attention_backends.VarlenKernel(lambda *a, **k: calls.append(1)))
    q, k, v = _qkv(19)
    with pytest.raises(ValueError, match="flash_attn runs on CUDA only"):
        flash_attn_attention(_Layer(), q, k, v, None, **_kwargs([5, 9, 3, 2], "cu_seq_lens"))
    assert calls == []
    assert attention_switch.available_backends("cpu") == ["sdpa_segments"]
    _install(monkeypatch, "flash_attn", make_flash_attn_varlen_func())
    assert attention_switch.available_backends("cpu", torch.float32) == ["flash_attn", "sdpa_segments"]
    assert attention_switch.available_backends("cpu", torch.bfloat16) == ["sdpa_segments"]
    with pytest.raises(ValueError, match="flash_attn takes float32/float64 activations, got torch.bfloat16"):
        flash_attn_attention(_Layer(), *(x.bfloat16() for x in (q, k, v)), None, **_kwargs([5, 9, 3, 2], "cu_seq_lens"))


# --------------------------------------------------------------------------------------------------------------
# Negative tests: a misread kernel makes the comparison fail
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("misread", "options"),
    [
        ("window_off_by_one", {"sliding_window": 3}),
        ("heads_first", {}),
        ("kv_swapped", {}),
        ("gqa_tiled", {"num_kv_heads": 2}),
    ],
)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_misread_kernel_fails_the_comparison(monkeypatch, name, misread, options):
    lengths = LAYOUTS["mixed_with_tail"]
    _install(monkeypatch, name, _MAKERS[name]())
    assert _max_diff(name, lengths, **options) <= TOL  # the correct kernel passes on these inputs
    _install(monkeypatch, name, _MAKERS[name](misread=misread))
    diff = _max_diff(name, lengths, **options)
    print(f"{name} with a kernel that misreads {misread}: max |diff| = {diff:.3g}")
    with pytest.raises(AssertionError):
        _assert_equal_to_sdpa_segments(name, lengths, **options)
    assert diff > 1e-2


# --------------------------------------------------------------------------------------------------------------
# Tiny models through the packed path: logits equal sdpa_segments'
# --------------------------------------------------------------------------------------------------------------

VOCAB = 64
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
)
WINDOW = 4


def _model(arch):
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    elif arch == "mistral_window":
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=WINDOW))
    else:
        config = Gemma2Config(**TINY, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=0.5,
                              initializer_range=0.5)
        model = Gemma2ForCausalLM(config)
        model.set_attn_implementation("eager")
    return model.eval()


def _packed():
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5, 6), (1, 1), (4, 5)]  # a 2-token sequence; total 29, 3 padding positions
    prompts = [torch.randint(1, VOCAB, (p,), generator=gen) for p, _ in shapes]
    responses = [torch.randint(1, VOCAB, (r,), generator=gen) for _, r in shapes]
    return pack_sequences(prompts, responses, pad_to=32)


def _logits(model, backend, packed):
    reset_call_counts()
    with torch.no_grad(), packed_attention(model, backend) as name:
        assert name == backend
        logits = model(**packed_model_inputs(packed)).logits
    assert call_counts() == {backend: 2}, "the backend served every layer"
    return logits


@pytest.mark.parametrize("arch", ["llama", "mistral_window", "gemma2_softcap"])
def test_model_logits_equal_sdpa_segments(backend, arch):
    model, packed = _model(arch), _packed()
    if backend == "torch_varlen" and arch == "gemma2_softcap":
        with pytest.raises(ValueError, match="torch_varlen' cannot honour logit soft-capping"):
            _logits(model, backend, packed)
        return
    assert resolve_backend(backend, "cpu", torch.float32) == backend
    diff = (_logits(model, backend, packed) - _logits(model, "sdpa_segments", packed)).abs().max().item()
    assert diff <= TOL, f"{arch} on {backend}: {diff:.3g}"


def test_model_with_a_misread_window_fails(monkeypatch):
    _install(monkeypatch, "flash_attn", make_flash_attn_varlen_func(misread="window_off_by_one"))
    model, packed = _model("mistral_window"), _packed()
    diff = (_logits(model, "flash_attn", packed) - _logits(model, "sdpa_segments", packed)).abs().max().item()
    print(f"Mistral logits with a window read off by one: max |diff| = {diff:.3g}")
    assert diff > 1e-3
