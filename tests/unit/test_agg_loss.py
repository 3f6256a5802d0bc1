"""agg_loss: hand-worked values, verl parity, layout/micro-batch/dp invariance, masked NaN.

Legend: `_BT` padded [B, T], `_T` packed [T].
"""

import math

import pytest
import torch

from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.aggregate import LossNormalizers, SeqLayout, agg_loss, agg_loss_with, count_tokens_and_seqs

NORM_FACTOR = 7.0  # the -norm constant used wherever the packed layout is involved


def test_token_sum_issue_example():
    # masked sums: row 0 = 1 + 2 = 3, row 1 = 4 + 6 = 10; total 13; times dp_size 4 = 52
    loss = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert agg_loss(loss, mask, "token-sum", dp_size=4).item() == 52.0


# Rows: s_0 = 1 + 2 = 3 (c_0 = 2); s_1 = 4 + 6 + 8 = 18 (c_1 = 3); row 2 fully masked (s_2 = 0, c_2 = 0).
# Local: N = 5 tokens, S = 2 sequences (the masked row counts for nothing), padded width 4.
LOSS_BT = [[1.0, 2.0, 30.0, 7.0], [4.0, 50.0, 6.0, 8.0], [9.0, 9.0, 9.0, 9.0]]
MASK_BT = [[1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0]]
HAND_LOCAL = {
    "token-mean": 21 / 5,  # (3 + 18) / 5 = 4.2
    "token-sum": 21.0,
    "seq-mean-token-sum": 21 / 2,  # 10.5
    "seq-mean-token-sum-norm": 21 / 2 / 4,  # 10.5 / width 4 = 2.625
    "seq-mean-token-mean": (3 / 2 + 18 / 3) / 2,  # (1.5 + 6) / 2 = 3.75
}
# Global counts N = 12, S = 6, dp_size 4, factor 7.
HAND_GLOBAL = {
    "token-mean": 21 / 12 * 4,  # 7
    "token-sum": 21 * 4,  # 84
    "seq-mean-token-sum": 21 / 6 * 4,  # 14
    "seq-mean-token-sum-norm": 21 / 6 * 4 / 7,  # 2
    "seq-mean-token-mean": 7.5 / 6 * 4,  # 5
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_hand_values_local_defaults(mode):
    got = agg_loss(torch.tensor(LOSS_BT), torch.tensor(MASK_BT), mode)
    assert got.item() == pytest.approx(HAND_LOCAL[mode], rel=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_hand_values_global_counts(mode):
    got = agg_loss(
        torch.tensor(LOSS_BT),
        torch.tensor(MASK_BT),
        mode,
        dp_size=4,
        global_num_tokens=12,
        global_num_seqs=6,
        loss_scale_factor=7.0,
    )
    assert got.item() == pytest.approx(HAND_GLOBAL[mode], rel=1e-7)


def _packed_example():
    # The same three sequences packed into one row of 10: segment 0 = [1, 2, 30], segment 1 = [4, 50, 6, 8],
    # segment 2 = [9, 9] (fully masked), then a tail of one token whose mask says 1 but lies after cu_seqlens[-1].
    loss_T = torch.tensor([1.0, 2.0, 30.0, 4.0, 50.0, 6.0, 8.0, 9.0, 9.0, 77.0])
    mask_T = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0, 0, 1])
    cu = torch.tensor([0, 3, 7, 9], dtype=torch.int32)
    return loss_T, mask_T, cu


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("row", [False, True])
def test_hand_values_packed(mode, row):
    loss_T, mask_T, cu = _packed_example()
    if row:
        loss_T, mask_T = loss_T[None], mask_T[None]
    kw = dict(dp_size=4, global_num_tokens=12, global_num_seqs=6, loss_scale_factor=7.0)
    assert agg_loss(loss_T, mask_T, mode, cu_seqlens=cu, **kw).item() == pytest.approx(HAND_GLOBAL[mode], rel=1e-7)
    local = agg_loss(loss_T, mask_T, mode, cu_seqlens=cu, loss_scale_factor=4.0).item()
    assert local == pytest.approx(HAND_LOCAL[mode], rel=1e-7)  # the tail's 77 never counts


def test_count_tokens_and_seqs():
    assert count_tokens_and_seqs(torch.tensor(MASK_BT)) == (5, 2)
    _, mask_T, cu = _packed_example()
    assert count_tokens_and_seqs(mask_T, cu) == (5, 2)


def test_layout_empty_segment_and_tail():
    # cu [0, 2, 2, 5] has an empty segment 1; tokens 5, 6 are the tail.
    layout = SeqLayout(torch.Size([7]), torch.tensor([0, 2, 2, 5]), torch.device("cpu"))
    assert layout.seq_index_T.tolist() == [0, 0, 2, 2, 2, 3, 3]
    x = torch.arange(1.0, 8.0)
    assert layout.seq_sum(torch.where(layout.in_seq_T, x, 0.0)).tolist() == [3.0, 0.0, 12.0]
    assert layout.broadcast(torch.tensor([10.0, 20.0, 30.0])).tolist() == [10, 10, 30, 30, 30, 0, 0]


def _verl_reference(loss, mask, mode, dp_size, n_tok, n_seq, factor):
    """verl 0.9.1's agg_loss, restated from its formulas (multiply by the mask; valid for finite inputs)."""
    m = mask.to(loss.dtype)
    seq_sum = (loss * m).sum(-1)
    seq_cnt = m.sum(-1)
    seq_has = (seq_cnt > 0).to(loss.dtype)
    if mode == "token-mean":
        return (loss * m).sum() / n_tok * dp_size
    if mode == "token-sum":
        return (loss * m).sum() * dp_size
    if mode == "seq-mean-token-mean":
        return (seq_sum / (seq_cnt + 1e-8) * seq_has).sum() / n_seq * dp_size
    out = (seq_sum * seq_has).sum() / n_seq * dp_size
    return out / factor if mode == "seq-mean-token-sum-norm" else out


@pytest.mark.parametrize("mode", AGG_MODES)
def test_verl_parity_padded(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.4).to(torch.int64)
    mask[2] = 0
    ref = _verl_reference(loss, mask, mode, 2, 40, 9, 5.0)
    got = agg_loss(loss, mask, mode, dp_size=2, global_num_tokens=40, global_num_seqs=9, loss_scale_factor=5.0)
    assert got.item() == pytest.approx(ref.item(), rel=1e-7)
    # With the defaults (local counts, width as the -norm factor), as verl's function alone.
    n_tok, n_seq = mask.sum(), (mask.sum(-1) > 0).sum()
    ref = _verl_reference(loss, mask, mode, 1, n_tok, n_seq, 9)
    assert agg_loss(loss, mask, mode).item() == pytest.approx(ref.item(), rel=1e-7)


# ---- invariance: micro-batches, dp ranks, packed vs padded -------------------------------------------------

B, T = 8, 9
LENGTHS = [9, 3, 0, 6, 1, 9, 5, 2]  # sequence i occupies tokens [0, L_i) of its row; row 2 is empty
PROMPT = [2, 1, 0, 0, 1, 3, 0, 2]  # the first P_i tokens are masked (a prompt); row 4 is then fully masked


def _batch():
    g = torch.Generator().manual_seed(1)
    feat_BTk = torch.randn(B, T, 3, generator=g, dtype=torch.float64)
    mask_BT = torch.zeros(B, T, dtype=torch.bool)
    for i, (length, prompt) in enumerate(zip(LENGTHS, PROMPT)):
        mask_BT[i, prompt:length] = True
    mask_BT[6, 2] = False  # a hole inside a sequence
    return feat_BTk, mask_BT


def _token_loss(feat, theta):
    z = feat @ theta
    return torch.tanh(z) + 0.3 * z.square()


def _pack(rows, feat_BTk, mask_BT, theta, tail=3):
    """Pack rows into one [T] stream with cu_seqlens and a NaN padding tail whose mask is 1 (must be ignored)."""
    pieces, masks, cu = [], [], [0]
    loss_BT = _token_loss(feat_BTk, theta)
    for i in rows:
        pieces.append(loss_BT[i, : LENGTHS[i]])
        masks.append(mask_BT[i, : LENGTHS[i]])
        cu.append(cu[-1] + LENGTHS[i])
    pieces.append(torch.full((tail,), math.nan, dtype=torch.float64))
    masks.append(torch.ones(tail, dtype=torch.bool))
    return torch.cat(pieces), torch.cat(masks), torch.tensor(cu, dtype=torch.int32)


def _global_norms(mask_BT, dp_size):
    n_tok, n_seq = count_tokens_and_seqs(mask_BT)
    return LossNormalizers(n_tok, n_seq, dp_size, NORM_FACTOR)


def _whole_batch(mode):
    feat, mask = _batch()
    theta = torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64, requires_grad=True)
    loss = agg_loss_with(_token_loss(feat, theta), mask, mode, _global_norms(mask, 1))
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.detach(), grad


def _simulated_fsdp(mode, rank_rows, micro_sizes, packed):
    """Each rank sums its micro-batch losses (global counts, dp_size); FSDP averages values and grads over ranks."""
    feat, mask = _batch()
    dp = len(rank_rows)
    norms = _global_norms(mask, dp)
    values, grads = [], []
    for rows in rank_rows:
        theta = torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64, requires_grad=True)
        total, start = 0.0, 0
        for size in micro_sizes(len(rows)):
            mb = rows[start : start + size]
            start += size
            if packed:
                loss_T, mask_T, cu = _pack(mb, feat, mask, theta)
                total = total + agg_loss_with(loss_T, mask_T, mode, norms, cu_seqlens=cu)
            else:
                total = total + agg_loss_with(_token_loss(feat[mb], theta), mask[mb], mode, norms)
        assert start == len(rows)
        (grad,) = torch.autograd.grad(total, theta)
        values.append(total.detach())
        grads.append(grad)
    return torch.stack(values).mean(), torch.stack(grads).mean(0)


def _uneven(n):
    """Micro-batch sizes 1, 2, rest (an empty rank gets one empty micro-batch, as the trainer's empty pack)."""
    sizes = [s for s in (min(n, 1), min(max(n - 1, 0), 2)) if s] + [max(n - 3, 0)]
    return [s for s in sizes if s] or [0]


LAYOUTS = {
    1: [list(range(B))],
    2: [[0, 1, 2], [3, 4, 5, 6, 7]],
    4: [[0], [1, 2, 3, 4], [5, 6], [7]],
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_invariance(mode, dp, packed):
    ref_value, ref_grad = _whole_batch(mode)
    value, grad = _simulated_fsdp(mode, LAYOUTS[dp], _uneven, packed)
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert ref_grad.abs().min() > 1e-3  # the gradient is not trivially zero


def test_invariance_with_an_empty_rank():
    # dp 4 where one rank has no sequences: it runs one empty micro-batch with zero loss and zero grad.
    for mode in AGG_MODES:
        ref_value, ref_grad = _whole_batch(mode)
        value, grad = _simulated_fsdp(mode, [[0, 1, 2, 3], [], [4, 5], [6, 7]], _uneven, packed=False)
        torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_per_microbatch_normalisation_fails_invariance(mode):
    """The bug we guard against: each micro-batch normalised by its own counts, micro-batch losses averaged."""
    ref_value, ref_grad = _whole_batch(mode)
    feat, mask = _batch()
    theta = torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64, requires_grad=True)
    rows, losses = list(range(B)), []
    start = 0
    for size in _uneven(B):
        mb = rows[start : start + size]
        start += size
        losses.append(agg_loss(_token_loss(feat[mb], theta), mask[mb], mode, loss_scale_factor=NORM_FACTOR))
    naive = torch.stack(losses).mean()
    (grad,) = torch.autograd.grad(naive, theta)
    assert abs(naive.item() - ref_value.item()) > 1e-2
    assert (grad - ref_grad).abs().max() > 1e-2


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_masked_nonfinite_never_leaks(mode, bad, packed):
    if packed:
        loss_T, mask_T, cu = _packed_example()
        loss = loss_T.clone()
        loss[(mask_T == 0) | (torch.arange(10) >= 9)] = bad
        mask, kw = mask_T, dict(cu_seqlens=cu, loss_scale_factor=4.0)
    else:
        loss = torch.tensor(LOSS_BT)
        mask = torch.tensor(MASK_BT)
        loss[mask == 0] = bad
        kw = {}
    loss.requires_grad_(True)
    out = agg_loss(loss, mask, mode, **kw)
    out.backward()
    assert out.item() == pytest.approx(HAND_LOCAL[mode], rel=1e-7)
    assert torch.isfinite(loss.grad).all()
    valid = (mask != 0) & (torch.arange(loss.shape[-1]) < 9) if packed else mask != 0
    assert (loss.grad[~valid] == 0).all()


def test_empty_batch_is_zero_not_nan():
    loss = torch.ones(2, 3, requires_grad=True)
    for mode in AGG_MODES:
        out = agg_loss(loss, torch.zeros(2, 3), mode)
        out.backward()
        assert out.item() == 0.0 and torch.isfinite(loss.grad).all()


def test_bf16_input_reduces_in_fp32():
    loss = torch.full((1, 1000), 1.0, dtype=torch.bfloat16)
    out = agg_loss(loss, torch.ones(1, 1000), "token-mean", global_num_tokens=1000)
    assert out.dtype == torch.float32 and out.item() == 1.0


def test_errors_name_the_fix():
    loss, mask = torch.tensor(LOSS_BT), torch.tensor(MASK_BT)
    with pytest.raises(ValueError, match="global_num_tokens"):
        agg_loss(loss, mask, "token-mean", dp_size=2)
    for mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        with pytest.raises(ValueError, match="global_num_seqs"):
            agg_loss(loss, mask, mode, dp_size=2, global_num_tokens=5)
    assert agg_loss(loss, mask, "token-sum", dp_size=2).item() == 42.0  # token-sum needs no count
    with pytest.raises(ValueError, match="choose one of"):
        agg_loss(loss, mask, "token_mean")
    loss_T, mask_T, cu = _packed_example()
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(loss_T, mask_T, "seq-mean-token-sum-norm", cu_seqlens=cu)
    with pytest.raises(ValueError, match="drop cu_seqlens"):
        agg_loss(loss, mask, "token-mean", cu_seqlens=cu)
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        agg_loss(loss_T, mask_T, "token-mean")
    with pytest.raises(ValueError, match="differ in shape"):
        agg_loss(loss, mask[:, :2], "token-mean")
    with pytest.raises(ValueError, match="dp_size"):
        LossNormalizers(5, 2, 0)


def test_empty_pack_with_only_a_tail():
    # packing's empty pack: cu_seqlens == [0] and a tail of masked padding; zero loss, zero finite grad
    loss = torch.full((1, 4), math.nan, requires_grad=True)
    for mode in AGG_MODES:
        out = agg_loss(loss, torch.zeros(1, 4), mode, dp_size=2, global_num_tokens=9, global_num_seqs=3,
                       loss_scale_factor=NORM_FACTOR, cu_seqlens=torch.tensor([0], dtype=torch.int32))
        out.backward()
        assert out.item() == 0.0 and (loss.grad == 0).all()
