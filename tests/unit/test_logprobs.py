"""Chunked log-probs/entropy == the naive full-logits reference, values and gradients; saved-for-backward bound.

Suffixes: `_T` [T], `_TH` [T, H], `_VH` [V, H], `_V` [V].
"""

import math

import pytest
import torch

from fsdptrain.rl import logprobs as logprobs_module
from fsdptrain.rl.logprobs import chunked_logprobs_entropy, naive_logprobs_entropy

NUM_TOKENS, VOCAB, HIDDEN = 37, 53, 16


def _inputs(seed=0, num_tokens=NUM_TOKENS, vocab=VOCAB, hidden=HIDDEN, dtype=torch.float32, bias=False):
    gen = torch.Generator().manual_seed(seed)
    hidden_TH = torch.randn(num_tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    bias_V = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_() if bias else None
    targets_T = torch.randint(vocab, (num_tokens,), generator=gen)
    # Upstream gradients with both signs, so every term of the backward matters.
    coef_lp_T = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    coef_ent_T = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    return hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T


def _values_and_grads(fn, hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T, **kwargs):
    params = [p for p in (hidden_TH, weight_VH, bias_V) if p is not None]
    logprobs_T, entropy_T = fn(hidden_TH, weight_VH, targets_T, bias_V=bias_V, **kwargs)
    loss = (logprobs_T * coef_lp_T.to(logprobs_T.dtype)).sum()
    if entropy_T is not None:
        loss = loss + (entropy_T * coef_ent_T.to(entropy_T.dtype)).sum()
    grads = torch.autograd.grad(loss, params)
    return logprobs_T.detach(), (None if entropy_T is None else entropy_T.detach()), grads


def _assert_close_to_max(actual, expected, rel=1e-6):
    """|actual - expected| <= rel * max|expected|, elementwise."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * float(expected.abs().max()))


@pytest.mark.parametrize("chunk_size", [1, 8, 10, NUM_TOKENS, 1000])  # 8, 10 do not divide 37; 1000 > T
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_matches_naive(chunk_size, temperature, bias):
    hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T = _inputs(bias=bias)
    args = (hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T)
    lp, ent, grads = _values_and_grads(chunked_logprobs_entropy, *args, temperature=temperature, chunk_size=chunk_size)
    lp_ref, ent_ref, grads_ref = _values_and_grads(naive_logprobs_entropy, *args, temperature=temperature)
    _assert_close_to_max(lp, lp_ref)
    _assert_close_to_max(ent, ent_ref)
    assert len(grads) == len(grads_ref) == (3 if bias else 2)
    for grad, grad_ref in zip(grads, grads_ref):
        _assert_close_to_max(grad, grad_ref)


def test_naive_reference_by_hand():
    # One token, V=3, H=1, weight = [[0], [ln 2], [ln 3]] ... hidden = 1: logits = [0, ln2, ln3], so
    # p = [1, 2, 3] / 6; log p(target=2) = ln(3/6) = -ln 2; entropy = -(1/6 ln(1/6) + 2/6 ln(2/6) + 3/6 ln(3/6)).
    hidden_TH = torch.ones(1, 1)
    weight_VH = torch.tensor([[0.0], [math.log(2.0)], [math.log(3.0)]])
    targets_T = torch.tensor([2])
    expected_ent = -sum(k / 6 * math.log(k / 6) for k in (1, 2, 3))
    for fn in (naive_logprobs_entropy, chunked_logprobs_entropy):
        lp, ent = fn(hidden_TH, weight_VH, targets_T)
        assert abs(lp.item() + math.log(2.0)) < 1e-6
        assert abs(ent.item() - expected_ent) < 1e-6


def test_logprobs_only():
    hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T = _inputs(seed=1, bias=True)
    args = (hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T)
    lp, ent, grads = _values_and_grads(chunked_logprobs_entropy, *args, chunk_size=9, compute_entropy=False)
    lp_ref, ent_ref, grads_ref = _values_and_grads(naive_logprobs_entropy, *args, compute_entropy=False)
    assert ent is None and ent_ref is None
    _assert_close_to_max(lp, lp_ref)
    for grad, grad_ref in zip(grads, grads_ref):
        _assert_close_to_max(grad, grad_ref)


@pytest.mark.parametrize("compute_entropy", [False, True])
def test_row_blocks_and_zero_upstream_gradients(monkeypatch, compute_entropy):
    # Row blocks of 3 inside chunks of 10 (the last block of a chunk and of the row shorter), and log-prob upstream
    # gradients that are exactly 0 for some tokens: the log-prob-only backward takes log|g| (-inf there).
    # float64, so that the comparison checks the algebra at 1e-12 rather than fp32 rounding.
    monkeypatch.setattr(logprobs_module, "_CPU_BLOCK_BYTES", 3 * 4 * VOCAB)
    hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T = _inputs(seed=3, bias=True, dtype=torch.float64)
    coef_lp_T[::4] = 0.0
    args = (hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T)
    lp, ent, grads = _values_and_grads(chunked_logprobs_entropy, *args, chunk_size=10, temperature=0.8,
                                       compute_entropy=compute_entropy)
    lp_ref, ent_ref, grads_ref = _values_and_grads(naive_logprobs_entropy, *args, temperature=0.8,
                                                   compute_entropy=compute_entropy)
    _assert_close_to_max(lp, lp_ref, rel=1e-12)
    if compute_entropy:
        _assert_close_to_max(ent, ent_ref, rel=1e-12)
    for grad, grad_ref in zip(grads, grads_ref):
        assert torch.isfinite(grad).all()
        _assert_close_to_max(grad, grad_ref, rel=1e-12)


def test_entropy_only_gradient():
    # Only the entropy feeds the loss: the log-prob's upstream gradient arrives as zeros.
    hidden_TH, weight_VH, _, targets_T, _, coef_ent_T = _inputs(seed=2)
    zeros_T = torch.zeros_like(coef_ent_T)
    args = (hidden_TH, weight_VH, None, targets_T, zeros_T, coef_ent_T)
    _, _, grads = _values_and_grads(chunked_logprobs_entropy, *args, chunk_size=5)
    _, _, grads_ref = _values_and_grads(naive_logprobs_entropy, *args)
    for grad, grad_ref in zip(grads, grads_ref):
        _assert_close_to_max(grad, grad_ref)
    ent_T = chunked_logprobs_entropy(hidden_TH, weight_VH, targets_T, chunk_size=5)[1]
    grads_ent = torch.autograd.grad((ent_T * coef_ent_T.float()).sum(), [hidden_TH, weight_VH])
    for grad, grad_ref in zip(grads_ent, grads_ref):
        _assert_close_to_max(grad, grad_ref)


def _tied_model_grads(fn, *, tie_input=True, **kwargs):
    """A tiny graph where one parameter is both the input embedding and the output weight (tie_input=False: the
    embedding lookup reads a detached copy, so only the output-weight use contributes a gradient)."""
    gen = torch.Generator().manual_seed(3)
    embedding_VH = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5)
    mix_HH = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
    input_ids_T = torch.randint(VOCAB, (NUM_TOKENS,), generator=gen)
    targets_T = torch.roll(input_ids_T, -1)
    input_table_VH = embedding_VH if tie_input else embedding_VH.detach()
    hidden_TH = torch.tanh(input_table_VH[input_ids_T] @ mix_HH)
    logprobs_T, entropy_T = fn(hidden_TH, embedding_VH, targets_T, temperature=1.3, **kwargs)
    loss = logprobs_T.sum() - 0.1 * entropy_T.sum()
    loss.backward()
    return loss.detach(), embedding_VH.grad, mix_HH.grad


def test_tied_embedding_gradients_accumulate():
    loss, grad_emb, grad_mix = _tied_model_grads(chunked_logprobs_entropy, chunk_size=6)
    loss_ref, grad_emb_ref, grad_mix_ref = _tied_model_grads(naive_logprobs_entropy)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    _assert_close_to_max(grad_emb, grad_emb_ref)
    _assert_close_to_max(grad_mix, grad_mix_ref)
    # The input-embedding path contributes for real, so the match above covers the accumulation of both uses.
    _, grad_emb_output_only, _ = _tied_model_grads(chunked_logprobs_entropy, tie_input=False, chunk_size=6)
    assert (grad_emb - grad_emb_output_only).abs().max() > 1e-2 * grad_emb.abs().max()


def test_bfloat16_inputs_compute_in_float32():
    hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T = _inputs(seed=4, dtype=torch.bfloat16, bias=True)
    args = (hidden_TH, weight_VH, bias_V, targets_T, coef_lp_T, coef_ent_T)
    lp, ent, grads = _values_and_grads(chunked_logprobs_entropy, *args, chunk_size=8, temperature=0.9)
    lp_ref, ent_ref, grads_ref = _values_and_grads(naive_logprobs_entropy, *args, temperature=0.9)
    assert lp.dtype == ent.dtype == torch.float32
    _assert_close_to_max(lp, lp_ref)
    _assert_close_to_max(ent, ent_ref)
    for grad, grad_ref, param in zip(grads, grads_ref, (hidden_TH, weight_VH, bias_V)):
        assert grad.dtype == param.dtype == torch.bfloat16
        # Both are float32 gradients rounded once to bf16: at most one bf16 ulp (2^-8 relative) apart.
        _assert_close_to_max(grad.float(), grad_ref.float(), rel=2**-7)


def test_autocast_does_not_lower_precision():
    hidden_TH, weight_VH, _, targets_T, _, _ = _inputs(seed=5)
    lp, ent = chunked_logprobs_entropy(hidden_TH, weight_VH, targets_T, chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_ac, ent_ac = chunked_logprobs_entropy(hidden_TH, weight_VH, targets_T, chunk_size=8)
    assert lp_ac.dtype == torch.float32
    _assert_close_to_max(lp_ac.detach(), lp.detach())
    _assert_close_to_max(ent_ac.detach(), ent.detach())


def test_empty_pack_gives_zero_weight_gradient():
    hidden_TH = torch.zeros(0, HIDDEN, requires_grad=True)
    weight_VH = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    logprobs_T, entropy_T = chunked_logprobs_entropy(hidden_TH, weight_VH, torch.zeros(0, dtype=torch.long))
    assert logprobs_T.shape == entropy_T.shape == (0,)
    (logprobs_T.sum() + entropy_T.sum()).backward()
    assert torch.equal(weight_VH.grad, torch.zeros(VOCAB, HIDDEN))
    assert hidden_TH.grad.shape == (0, HIDDEN)


def _saved_bytes(fn, *args, **kwargs):
    """Bytes of every tensor the autograd graph of fn(*args) keeps for backward (saved tensors and tensors on ctx)."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs_T, entropy_T = fn(*args, **kwargs)
    # A custom Function's ctx could hold tensors as attributes, out of the hooks' sight: count those too.
    ctx_attrs = getattr(logprobs_T.grad_fn, "__dict__", {})
    ctx_tensors = [v for v in ctx_attrs.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in saved + ctx_tensors)


def test_saved_for_backward_is_linear_not_tokens_times_vocab():
    num_tokens, vocab, hidden = 512, 1000, 8
    hidden_TH, weight_VH, bias_V, targets_T, _, _ = _inputs(num_tokens=num_tokens, vocab=vocab, hidden=hidden, bias=True)
    saved = _saved_bytes(chunked_logprobs_entropy, hidden_TH, weight_VH, targets_T, bias_V=bias_V, chunk_size=64)
    # Inputs (fp32 hidden, weight, bias; int64 targets) plus two fp32 [T] statistics: 4*(T*H + V*H + V) + 8*T + 8*T.
    bound = 4 * (num_tokens * hidden + vocab * hidden + vocab) + 16 * num_tokens
    assert saved <= bound
    assert saved < 4 * num_tokens * vocab / 20
    # The hook sees what the naive path keeps: at least the fp32 [T, V] log-softmax output.
    naive_saved = _saved_bytes(naive_logprobs_entropy, hidden_TH, weight_VH, targets_T, bias_V=bias_V)
    assert naive_saved >= 4 * num_tokens * vocab


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(6)
    hidden_TH = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight_VH = torch.randn(7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    bias_V = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    targets_T = torch.randint(7, (5,), generator=gen)

    def fn(hidden_TH, weight_VH, bias_V):
        return chunked_logprobs_entropy(hidden_TH, weight_VH, targets_T, temperature=0.8, chunk_size=2, bias_V=bias_V)

    assert fn(hidden_TH, weight_VH, bias_V)[0].dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (hidden_TH, weight_VH, bias_V))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(targets_T=torch.full((NUM_TOKENS,), -100)), "valid id"),
        (dict(targets_T=torch.full((NUM_TOKENS,), VOCAB)), "valid id"),
        (dict(hidden_TH=torch.zeros(1, NUM_TOKENS, HIDDEN)), r"\[T, H\]"),
        (dict(bias_V=torch.zeros(VOCAB + 1)), "bias"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    hidden_TH, weight_VH, _, targets_T, _, _ = _inputs()
    call = dict(hidden_TH=hidden_TH, weight_VH=weight_VH, targets_T=targets_T) | kwargs
    with pytest.raises(ValueError, match=match):
        chunked_logprobs_entropy(**call)
