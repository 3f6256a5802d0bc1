"""Policy loss: hand-worked clipping cases, KL estimators, entropy, GSPO ratio, layouts, masked NaN."""

import math

import pytest
import torch

from fsdptrain.registry import names
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import Kind, close_minibatch, finalize, merge_all
from fsdptrain.rl.policy_loss import entropy_from_logits, kl_penalty, policy_loss

LOG = math.log

# Five single tokens, clip_ratio_low 0.2, clip_ratio_high 0.3, dual-clip c = 3:
#   ratio  A   unclipped -A r   clipped -A clip(r, .8, 1.3)   max     dual -A c   final   case
#   1.1    2        -2.2            -2.2                      -2.2        -        -2.2   unclipped
#   1.5    1        -1.5            -1.3                      -1.3        -        -1.3   clipped above
#   0.5   -1         0.5             0.8                       0.8       3          0.8   clipped below
#   0.5    1        -0.5            -0.8                      -0.5        -        -0.5   pessimistic: unclipped wins
#   5.0   -1         5.0             1.3                       5.0       3          3.0   dual-clipped
RATIOS = [1.1, 1.5, 0.5, 0.5, 5.0]
ADVS = [2.0, 1.0, -1.0, 1.0, -1.0]
PG = [-2.2, -1.3, 0.8, -0.5, 3.0]
# d pg / d logp = -A r on the unclipped branch, 0 where a clip bound: [-2.2, 0, 0, -0.5, 0]
DPG = [-2.2, 0.0, 0.0, -0.5, 0.0]


def _norms(n_tok=5, n_seq=1, dp=1, factor=None):
    return LossNormalizers(n_tok, n_seq, dp, factor)


def _case(dual=3.0, mode="token-mean", norms=None):
    old = torch.tensor([[-1.0] * 5], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([RATIOS], dtype=torch.float64))).requires_grad_(True)
    adv = torch.tensor([ADVS], dtype=torch.float64)
    loss, metrics = policy_loss(
        logp,
        old,
        adv,
        torch.ones(1, 5),
        norms=norms or _norms(),
        agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.3,
        clip_ratio_c=dual,
    )
    loss.backward()
    return loss, metrics, logp.grad


@pytest.mark.parametrize("i", range(5))
def test_each_clipping_case_alone(i):
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logp = (old + LOG(RATIOS[i])).requires_grad_(True)
    loss, _ = policy_loss(
        logp,
        old,
        torch.tensor([[ADVS[i]]], dtype=torch.float64),
        torch.ones(1, 1),
        norms=_norms(1, 1),
        agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.3,
        clip_ratio_c=3.0,
    )
    loss.backward()
    assert loss.item() == pytest.approx(PG[i], abs=1e-12)
    assert logp.grad.item() == pytest.approx(DPG[i], abs=1e-12)


def test_clipping_cases_together_and_metrics():
    loss, metrics, grad = _case()
    # token-mean: (-2.2 - 1.3 + 0.8 - 0.5 + 3.0) / 5 = -0.2 / 5 = -0.04
    assert loss.item() == pytest.approx(-0.04, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([DPG], dtype=torch.float64) / 5, rtol=0, atol=1e-12)
    out = finalize(metrics)
    assert out["pg_loss"] == pytest.approx(-0.04, abs=1e-12)
    assert out["pg_clipfrac"] == pytest.approx(2 / 5)  # clipped above and below
    assert out["pg_clipfrac_lower"] == pytest.approx(1 / 5)  # the dual-clipped token
    assert out["probs_ratio_min"] == pytest.approx(0.5)
    assert out["probs_ratio_max"] == pytest.approx(5.0)
    assert out["probs_ratio_mean"] == pytest.approx(8.6 / 5)  # (1.1 + 1.5 + 0.5 + 0.5 + 5) / 5
    # ppo_kl = mean(old - logp) = -ln(1.1 * 1.5 * 0.5 * 0.5 * 5) / 5 = -ln(2.0625) / 5
    assert out["ppo_kl"] == pytest.approx(-LOG(2.0625) / 5, abs=1e-12)
    kinds = {name: m.kind for name, m in metrics.items()}
    assert kinds["pg_loss"] is Kind.LOSS and kinds["pg_clipfrac"] is Kind.MEAN
    assert kinds["probs_ratio_min"] is Kind.MIN and kinds["probs_ratio_max"] is Kind.MAX


def test_without_dual_clip_the_negative_advantage_is_unbounded():
    loss, metrics, grad = _case(dual=None)
    # last token: 5.0 instead of 3.0 -> (-0.2 + 2) / 5 = 0.36; its grad -A r / 5 = 5 / 5 = 1
    assert loss.item() == pytest.approx(0.36, abs=1e-12)
    assert grad[0, 4].item() == pytest.approx(1.0, abs=1e-12)
    assert finalize(metrics)["pg_clipfrac_lower"] == 0.0


def test_loss_metric_is_logged_without_dp_factor():
    # dp 4, N = 10: the rank's loss is -0.2 / 10 * 4 = -0.08 and its metric share -0.2 / 10 = -0.02
    loss, metrics, _ = _case(norms=_norms(10, 2, 4))
    assert loss.item() == pytest.approx(-0.08, abs=1e-12)
    assert finalize(metrics)["pg_loss"] == pytest.approx(-0.02, abs=1e-12)


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    # d = logp - ref = [0.5, -1.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5], dtype=torch.float64))
    # k3 = exp(-d) + d - 1 = [e^-0.5 - 0.5, e - 2] = [0.10653065971263342, 0.7182818284590451]
    k3 = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(k3, torch.tensor([0.10653065971263342, 0.7182818284590451], dtype=torch.float64))
    with pytest.raises(ValueError, match="k1, k2, k3, abs, mse, k1\\+, k3\\+"):
        kl_penalty(logp, ref, "low_var_kl")


def _kl_value_and_grad(estimator, d, kl_clamp=10.0):
    """Value and d/d logp of one token's estimate with ref_logp = -1 and logp = -1 + d."""
    logp = torch.tensor([-1.0 + d], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-1.0], dtype=torch.float64), estimator, kl_clamp=kl_clamp)
    kl.sum().backward()
    return kl.item(), logp.grad.item()


@pytest.mark.parametrize("estimator, d, value, grad", [
    # k1 = d, grad 1; k2 = mse = d^2/2, grad d; abs = |d|, grad sign(d)
    ("k1", 0.5, 0.5, 1.0),
    ("k2", 0.5, 0.125, 0.5),
    ("mse", -1.0, 0.5, -1.0),
    ("abs", -1.0, 1.0, -1.0),
    ("abs", 0.5, 0.5, 1.0),
    # k3 = e^-d + d - 1, grad 1 - e^-d: d = -1 -> e - 2, grad 1 - e
    ("k3", -1.0, math.e - 2.0, 1.0 - math.e),
    # straight-through: the value of k1 / k3, the gradient of k2 (= d)
    ("k1+", 0.5, 0.5, 0.5),
    ("k1+", -1.0, -1.0, -1.0),
    ("k3+", -1.0, math.e - 2.0, -1.0),
    ("k3+", 0.5, math.exp(-0.5) - 0.5, 0.5),
    # abs+: value |d|, gradient d (not sign(d)): d = -1 -> 1, -1; d = 0.5 -> 0.5, 0.5; d = 2 -> 2, 2
    ("abs+", -1.0, 1.0, -1.0),
    ("abs+", 0.5, 0.5, 0.5),
    ("abs+", 2.0, 2.0, 2.0),
])
def test_kl_estimator_values_and_gradients(estimator, d, value, grad):
    got_value, got_grad = _kl_value_and_grad(estimator, d)
    assert got_value == pytest.approx(value, abs=1e-12)
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_k3_is_clamped_at_ten_with_zero_gradient():
    # d = -6: k3 = e^6 - 6 - 1 = 396.43 > 10 -> 10, and the clamp passes no gradient
    assert _kl_value_and_grad("k3", -6.0) == (10.0, 0.0)
    # k3+ clamps its value, and keeps k2's gradient d = -6
    assert _kl_value_and_grad("k3+", -6.0) == (10.0, -6.0)
    # no clamp: the full value and gradient 1 - e^6
    value, grad = _kl_value_and_grad("k3", -6.0, kl_clamp=None)
    assert value == pytest.approx(math.exp(6.0) - 6.0 - 1.0, abs=1e-10)
    assert grad == pytest.approx(1.0 - math.exp(6.0), abs=1e-10)
    # a clamp above the value changes nothing; the clamp never touches k1/k2
    assert _kl_value_and_grad("k3", -1.0, kl_clamp=1.0) == pytest.approx((math.e - 2.0, 1.0 - math.e), abs=1e-12)
    assert _kl_value_and_grad("k2", -6.0) == (18.0, -6.0)
    with pytest.raises(ValueError, match="kl_clamp"):
        _kl_value_and_grad("k3", -6.0, kl_clamp=0.0)


def test_kl_clamp_reaches_the_policy_loss():
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    ref = torch.tensor([[5.0]], dtype=torch.float64)  # d = -6
    kw = dict(norms=_norms(1, 1), agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
              ref_logprobs=ref, kl_coef=1.0)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, zero, torch.ones(1, 1), **kw)
    assert loss.item() == 10.0 and finalize(metrics)["kl"] == 10.0
    loss, metrics = policy_loss(logp, old, zero, torch.ones(1, 1), kl_clamp=None, **kw)
    assert loss.item() == pytest.approx(math.exp(6.0) - 7.0, abs=1e-10)


def test_entropy_of_known_distributions():
    # uniform over 4: ln 4; softmax([0, ln 3]) = [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351446188083
    ent = entropy_from_logits(torch.zeros(1, 4, dtype=torch.float64))
    assert ent.shape == (1,) and ent.item() == pytest.approx(LOG(4.0), abs=1e-12)
    two = entropy_from_logits(torch.tensor([0.0, LOG(3.0), -math.inf], dtype=torch.float64))
    assert two.item() == pytest.approx(0.5623351446188083, abs=1e-12)


def test_kl_and_entropy_terms_in_the_loss():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    ent = torch.tensor([[0.4, 0.8]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        logp,
        old,
        torch.zeros(1, 2, dtype=torch.float64),  # A = 0: pg is 0
        torch.ones(1, 2),
        norms=_norms(2, 1),
        agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_estimator="k1",
        entropy=ent,
        entropy_coef=0.01,
    )
    # kl_loss = mean k1 = (0.5 - 1) / 2 = -0.25; entropy mean 0.6; loss = 0 + 0.1 * -0.25 - 0.01 * 0.6 = -0.031
    assert loss.item() == pytest.approx(-0.031, abs=1e-12)
    out = finalize(metrics)
    assert out["kl_loss"] == pytest.approx(-0.25) and out["kl"] == pytest.approx(-0.25)
    assert out["entropy"] == pytest.approx(0.6)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.full((1, 2), -0.005, dtype=torch.float64))  # -0.01 / 2
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, old, torch.ones(1, 2), norms=_norms(), agg_mode="token-mean",
                    clip_ratio_low=0.2, clip_ratio_high=0.2, kl_coef=0.1)


def _gspo_inputs():
    # seq 0: 3 tokens, log-ratios [0.1, 0.2, 0.3] -> s_0 = exp(0.2); A = +1
    # seq 1: 2 tokens, the second masked (NaN there), log-ratio [-0.4] -> s_1 = exp(-0.4); A = -1
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, math.nan, 0.0]], dtype=torch.float64)
    delta = torch.tensor([[0.1, 0.2, 0.3], [-0.4, math.nan, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, math.nan, 0.0]], dtype=torch.float64)
    return old, old + delta, adv, mask


def test_gspo_sequence_ratio_two_lengths():
    old, logp0, adv, mask = _gspo_inputs()
    logp = logp0.clone().requires_grad_(True)
    kw = dict(norms=_norms(4, 2), agg_mode="seq-mean-token-mean", clip_ratio_low=0.5, clip_ratio_high=0.5)
    loss, metrics = policy_loss(logp, old, adv, mask, seq_level_ratio=True, **kw)
    s0, s1 = math.exp(0.2), math.exp(-0.4)
    # seq-mean-token-mean: (mean of -s0 over 3 tokens + s1) / 2
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    out = finalize(metrics)
    assert out["probs_ratio_min"] == pytest.approx(s1) and out["probs_ratio_max"] == pytest.approx(s0)
    assert out["probs_ratio_mean"] == pytest.approx((3 * s0 + s1) / 4)  # token-weighted
    loss.backward()
    # Reference: the sequence objective written directly, -(1/2) sum_i A_i exp(mean_t log-ratio_i)
    ref_logp = logp0.clone().nan_to_num(0.0).requires_grad_(True)
    r0 = torch.exp((ref_logp[0] - old[0]).mean())
    r1 = torch.exp(ref_logp[1, 0] - old[1, 0])
    (-(r0 - r1) / 2).backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=0, atol=1e-12)
    # by hand: d/dlogp_0t = -s0 / 6, d/dlogp_10 = s1 / 2, masked 0
    assert logp.grad[0, 0].item() == pytest.approx(-s0 / 6, abs=1e-12)
    assert logp.grad[1, 0].item() == pytest.approx(s1 / 2, abs=1e-12)


def test_gspo_packed_equals_padded():
    old, logp0, adv, mask = _gspo_inputs()
    kw = dict(norms=_norms(4, 2), agg_mode="seq-mean-token-mean", clip_ratio_low=0.1, clip_ratio_high=0.1,
              seq_level_ratio=True)
    logp = logp0.clone().requires_grad_(True)
    loss, m_pad = policy_loss(logp, old, adv, mask, **kw)
    loss.backward()
    # packed: [seq0 (3), seq1 (2)], then a tail of 1
    pick = lambda x, tail: torch.cat([x[0], x[1, :2], torch.tensor([tail], dtype=x.dtype)])  # noqa: E731
    logp_T = pick(logp0, 0.0).requires_grad_(True)
    loss_T, m_pack = policy_loss(logp_T, pick(old, 0.0), pick(adv, 5.0), pick(mask, 1),
                                 cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32), **kw)
    loss_T.backward()
    assert loss_T.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(logp_T.grad[:5], torch.cat([logp.grad[0], logp.grad[1, :2]]))
    assert finalize(m_pack) == pytest.approx(finalize(m_pad))


def _random_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 0, 7, 3, 6]
    B, T = len(lengths), 7
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    mask[3, 0] = False
    rnd = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    old = rnd() - 2
    logp = old + 0.3 * rnd()
    return dict(lengths=lengths, mask=mask, old=old, logp=logp, adv=rnd(), ref=old + 0.2 * rnd(),
                ent=rnd().abs())


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("gspo", [False, True])
def test_microbatched_packed_equals_whole_padded(mode, gspo):
    """Value, gradient and comparable metrics agree: whole padded batch vs packed micro-batches on 2 ranks."""
    b = _random_batch()
    n_tok = int(b["mask"].sum())
    n_seq = int((b["mask"].sum(-1) > 0).sum())
    kw = dict(agg_mode=mode, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=2.0, seq_level_ratio=gspo,
              kl_coef=0.05, entropy_coef=0.01, kl_estimator="k3")

    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, b["old"], b["adv"], b["mask"], norms=LossNormalizers(n_tok, n_seq, 1, 5.0),
                                ref_logprobs=b["ref"], entropy=b["ent"], **kw)
    loss.backward()
    ref = finalize(close_minibatch(metrics))

    logp2 = b["logp"].clone().requires_grad_(True)
    norms = LossNormalizers(n_tok, n_seq, 2, 5.0)
    grads, collected = [], []
    for rank_rows in ([[0], [1, 2]], [[3, 4, 5]]):
        rank_total = 0.0
        for rows in rank_rows:
            cat = lambda x: torch.cat([x[i, : b["lengths"][i]] for i in rows] + [x.new_zeros(2)])  # noqa: E731
            cu = torch.tensor([0] + [sum(b["lengths"][i] for i in rows[: k + 1]) for k in range(len(rows))])
            mask_T = torch.cat([b["mask"][i, : b["lengths"][i]] for i in rows] + [torch.ones(2, dtype=torch.bool)])
            part, m = policy_loss(cat(logp2), cat(b["old"]), cat(b["adv"]), mask_T, norms=norms, cu_seqlens=cu,
                                  ref_logprobs=cat(b["ref"]), entropy=cat(b["ent"]), **kw)
            rank_total = rank_total + part
            collected.append(m)
        (g,) = torch.autograd.grad(rank_total, logp2)
        grads.append(g)
    torch.testing.assert_close((grads[0] + grads[1]) / 2, logp.grad, rtol=1e-10, atol=1e-12)
    got = finalize(close_minibatch(merge_all(collected)))
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_nan_gives_finite_loss_and_grad(mode):
    b = _random_batch(1)
    bad = ~b["mask"]
    nanify = lambda x: torch.where(bad, torch.full_like(x, math.nan), x)  # noqa: E731
    logp = nanify(b["logp"]).requires_grad_(True)
    ent = nanify(b["ent"]).requires_grad_(True)
    loss, metrics = policy_loss(logp, nanify(b["old"]), nanify(b["adv"]), b["mask"],
                                norms=LossNormalizers(int(b["mask"].sum()), 5, 1, 4.0), agg_mode=mode,
                                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, seq_level_ratio=True,
                                ref_logprobs=nanify(b["ref"]), kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all() and (logp.grad[bad] == 0).all()
    assert torch.isfinite(ent.grad).all() and (ent.grad[bad] == 0).all()
    assert all(math.isfinite(v) for v in finalize(metrics).values())


def test_empty_pack_returns_the_same_names():
    z = torch.zeros(1, 4, dtype=torch.float64)
    kw = dict(norms=_norms(), agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
              ref_logprobs=z, kl_coef=0.1, entropy=z, entropy_coef=0.0)
    _, full = policy_loss(z, z, z, torch.ones(1, 4), **kw)
    loss, empty = policy_loss(z, z, z, torch.zeros(1, 4), **kw)
    assert list(full) == list(empty) and loss.item() == 0.0
    # An empty pack's extrema and means are undefined, so they are absent; the LOSS parts are 0.
    assert set(finalize(empty)) == {"pg_loss", "kl_loss"}


def test_dual_clip_must_exceed_one():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(z, z, z, torch.ones(1, 1), norms=_norms(), agg_mode="token-mean", clip_ratio_low=0.2,
                    clip_ratio_high=0.2, clip_ratio_c=0.9)


@pytest.mark.parametrize("estimator", names.KL_ESTIMATORS)
def test_check_metrics_reference_kl_matches_kl_penalty(estimator):
    """check-metrics' own KL (`fsdptrain.check.reference.kl_direct`) agrees with `kl_penalty` for every name, in value
    and gradient, on both sides of 0 and past the clamp."""
    from fsdptrain.check.reference import kl_direct

    ref = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    grads = []
    values = []
    for fn in (lambda lp: kl_penalty(lp, ref, estimator, kl_clamp=10.0), lambda lp: kl_direct(lp, ref, estimator, 10.0)):
        logp = (ref + torch.tensor([-6.0, -1.0, 0.5, 2.0], dtype=torch.float64)).requires_grad_()
        kl = fn(logp)
        kl.sum().backward()
        values.append(kl.detach())
        grads.append(logp.grad)
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
