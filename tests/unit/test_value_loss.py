"""Value loss: clipped and unclipped by hand, critic metrics merged over sequences and layouts."""

import math

import pytest
import torch

from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import Kind, finalize, merge_all
from fsdptrain.rl.value_loss import value_loss

F64 = torch.float64

# v = [1, 2, 3], old = 1.5 everywhere, R = [2, 0, 3.5], c = 0.2 -> clip(v) = [1.3, 1.7, 1.7]
#   token 0: (1 - 2)^2 = 1       vs (1.3 - 2)^2 = 0.49  -> 1     -> 0.5    grad v - R = -1
#   token 1: (2 - 0)^2 = 4       vs (1.7 - 0)^2 = 2.89  -> 4     -> 2      grad 2
#   token 2: (3 - 3.5)^2 = 0.25  vs (1.7 - 3.5)^2 = 3.24 -> 3.24 -> 1.62  grad 0 (clipped, saturated)
V = [[1.0, 2.0, 3.0]]
OLD = [[1.5, 1.5, 1.5]]
R = [[2.0, 0.0, 3.5]]


def _run(cliprange, mode="token-mean", norms=None):
    v = torch.tensor(V, dtype=F64, requires_grad=True)
    loss, metrics = value_loss(v, torch.tensor(OLD, dtype=F64), torch.tensor(R, dtype=F64), torch.ones(1, 3),
                               norms=norms or LossNormalizers(3, 1), agg_mode=mode, cliprange_value=cliprange)
    loss.backward()
    return loss, metrics, v.grad


def test_clipped_by_hand():
    loss, metrics, grad = _run(0.2)
    assert loss.item() == pytest.approx(4.12 / 3, abs=1e-12)  # (0.5 + 2 + 1.62) / 3
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 2.0, 0.0]], dtype=F64) / 3)
    out = finalize(metrics)
    assert out["vf_loss"] == pytest.approx(4.12 / 3, abs=1e-12)
    assert out["vf_clipfrac"] == pytest.approx(1 / 3)
    assert out["values_mean"] == pytest.approx(2.0) and out["returns_mean"] == pytest.approx(5.5 / 3)
    assert out["values_min"] == 1.0 and out["values_max"] == 3.0
    # r - v = [1, -2, 0.5]; Var(r) = 16.25/3 - (5.5/3)^2 = 18.5/9; Var(r - v) = 5.25/3 - (0.5/3)^2 = 15.5/9
    assert out["vf_explained_var"] == pytest.approx(1 - 15.5 / 18.5, abs=1e-12)
    assert metrics["vf_explained_var"].kind is Kind.DERIVED and metrics["vf_loss"].kind is Kind.LOSS


def test_unclipped_by_hand():
    loss, metrics, grad = _run(None)
    assert loss.item() == pytest.approx(0.875, abs=1e-12)  # 0.5 * (1 + 4 + 0.25) / 3
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 2.0, -0.5]], dtype=F64) / 3)
    assert finalize(metrics)["vf_clipfrac"] == 0.0
    # a wide clip range clips nothing: the same loss
    assert _run(10.0)[0].item() == pytest.approx(0.875, abs=1e-12)


def test_vf_loss_metric_without_dp_factor():
    loss, metrics, _ = _run(0.2, mode="token-sum", norms=LossNormalizers(3, 1, dp_size=2))
    assert loss.item() == pytest.approx(4.12 * 2, abs=1e-12)
    assert finalize(metrics)["vf_loss"] == pytest.approx(4.12, abs=1e-12)


def _per_sequence_metrics(values, masks):
    out = []
    for vals, mask in zip(values, masks):
        v = torch.tensor([vals], dtype=F64)
        _, m = value_loss(v, v, v + 1.0, torch.tensor([mask]), norms=LossNormalizers(9, 3),
                          agg_mode="token-mean", cliprange_value=0.2)
        out.append(m)
    return finalize(merge_all(out))


def test_critic_extrema_merged_over_sequences():
    seqs = [[3.0, 5.0, 4.0], [6.0, 9.0, 7.0], [8.0, 8.5, 8.2]]
    out = _per_sequence_metrics(seqs, [[1, 1, 1]] * 3)
    assert (out["values_min"], out["values_max"]) == (3.0, 9.0)
    # third sequence fully masked: still 3 and 9 (an empty sequence is the identity, never 0.0)
    out = _per_sequence_metrics(seqs, [[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    assert (out["values_min"], out["values_max"]) == (3.0, 9.0)
    assert out["values_mean"] == pytest.approx(34.0 / 6)  # (12 + 22) / 6 tokens
    # a set spanning -3..9
    out = _per_sequence_metrics([[-3.0, 0.0, 2.0], [5.0, 9.0, 1.0]], [[1, 1, 1], [1, 1, 1]])
    assert (out["values_min"], out["values_max"]) == (-3.0, 9.0)
    # a fully masked batch: the extrema (and undefined means and EV) are absent
    out = _per_sequence_metrics(seqs, [[0, 0, 0]] * 3)
    assert "values_min" not in out and "values_max" not in out
    assert "values_mean" not in out and "vf_explained_var" not in out
    assert out["vf_loss"] == 0.0


def test_packed_and_split_metrics_match_whole_batch():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4, 5, generator=g, dtype=F64)
    old = v + 0.3 * torch.randn(4, 5, generator=g, dtype=F64)
    ret = torch.randn(4, 5, generator=g, dtype=F64) * 2
    lengths = [5, 2, 0, 4]
    mask = torch.zeros(4, 5, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    norms = LossNormalizers(int(mask.sum()), 3, 1)
    kw = dict(norms=norms, agg_mode="seq-mean-token-mean", cliprange_value=0.2)
    whole_loss, whole = value_loss(v, old, ret, mask, **kw)
    parts, total = [], 0.0
    for rows in ([0], [1, 2, 3]):
        tail = torch.full((2,), math.nan, dtype=F64)
        cat = lambda x: torch.cat([x[i, : lengths[i]] for i in rows] + [tail])  # noqa: E731
        cu = torch.tensor([0] + [sum(lengths[i] for i in rows[: k + 1]) for k in range(len(rows))])
        mask_T = torch.cat([mask[i, : lengths[i]] for i in rows] + [torch.ones(2, dtype=torch.bool)])
        loss, m = value_loss(cat(v), cat(old), cat(ret), mask_T, cu_seqlens=cu, **kw)
        total = total + loss
        parts.append(m)
    assert total.item() == pytest.approx(whole_loss.item(), abs=1e-12)
    got, ref = finalize(merge_all(parts)), finalize(whole)
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-10, abs=1e-12), k


def test_masked_nan_is_harmless():
    v = torch.tensor([[1.0, math.nan]], dtype=F64, requires_grad=True)
    nan_row = torch.tensor([[1.0, math.nan]], dtype=F64)
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        v.grad = None
        loss, metrics = value_loss(v, nan_row, nan_row + 1, torch.tensor([[1, 0]]), norms=LossNormalizers(1, 1),
                                   agg_mode=mode, cliprange_value=0.5)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(v.grad).all() and v.grad[0, 1] == 0
        assert all(math.isfinite(x) for x in finalize(metrics).values())


def test_unclipped_token_is_not_counted_as_clipped():
    # v = -0.2, old = -0.5, c = 0.5: |v - old| = 0.3 < c, so clip(v) = v and the clipped error equals the unclipped
    # one. Rebuilding clip(v) as old + (v - old).clamp(-c, c) gives -0.19999998808 in fp32, one step from v, whose
    # error to R = -1.9 is the larger: the old code logged vf_clipfrac 1.0.
    v = torch.tensor([[-0.2]], requires_grad=True)
    loss, metrics = value_loss(v, torch.tensor([[-0.5]]), torch.tensor([[-1.9]]), torch.ones(1, 1),
                               norms=LossNormalizers(1, 1), agg_mode="token-mean", cliprange_value=0.5)
    loss.backward()
    assert finalize(metrics)["vf_clipfrac"] == 0.0
    assert loss.item() == pytest.approx(0.5 * 1.7**2, abs=1e-6)
    assert v.grad.item() == pytest.approx(-0.2 + 1.9, abs=1e-6)  # d/dv 0.5 (v - R)^2 on the unclipped branch


def test_clipfrac_matches_an_independent_count_on_normal_samples():
    # fp32 N(0, 1) values, old values and returns; the reference count is done in float64 from the definition:
    # a token is clipped iff |v - old| > c and the error of the bound it hits, |old + sign(v - old) c - R|, exceeds
    # |v - R|. (Ties have probability 0.)
    gen = torch.Generator().manual_seed(0)
    n, c = 200_000, 0.5
    v, old, ret = (torch.randn(1, n, generator=gen) for _ in range(3))
    _, metrics = value_loss(v, old, ret, torch.ones(1, n), norms=LossNormalizers(n, 1), agg_mode="token-mean",
                            cliprange_value=c)
    v64, old64, ret64 = v.double(), old.double(), ret.double()
    bound = old64 + torch.sign(v64 - old64) * c
    expected = (((v64 - old64).abs() > c) & ((bound - ret64).abs() > (v64 - ret64).abs())).sum().item()
    got = metrics["vf_clipfrac"]
    assert got.count.item() == n
    assert got.total.item() == expected
