"""Off-policy correction weights (TIS/MIS, token/sequence) and DAPO's dynamic-sampling filter, by hand."""

import math

import pytest
import torch

from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.dynamic_sampling import groups_with_signal
from fsdptrain.metrics.typed import Kind, finalize, merge
from fsdptrain.rl.policy_loss import policy_loss
from fsdptrain.rl.rollout_correction import rollout_correction_weights, rollout_rejection_mask

F64 = torch.float64
LN2 = math.log(2.0)

# token log-ratios old - behaviour = [0, ln 2, ln 4, -ln 2] -> w = [1, 2, 4, 0.5]; a fifth, masked token is NaN
OLD = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]], dtype=F64)
BEHAVIOUR = torch.tensor([[-1.0, -1.0 - LN2, -1.0 - 2 * LN2, -1.0 + LN2, math.nan]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 1, 0]])


@pytest.mark.parametrize("mode, weights, mean, max_", [
    ("tis", [1.0, 2.0, 3.0, 0.5, 0.0], 6.5 / 4, 3.0),   # min(w, 3)
    ("mis", [1.0, 2.0, 0.0, 0.5, 0.0], 3.5 / 4, 2.0),   # w if w <= 3 else 0
])
def test_token_level_by_hand(mode, weights, mean, max_):
    w, metrics = rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode=mode, level="token", cap=3.0)
    torch.testing.assert_close(w, torch.tensor([weights], dtype=F64), rtol=0, atol=1e-12)
    out = finalize(metrics)
    assert out["rollout_is_mean"] == pytest.approx(mean, abs=1e-12)
    assert out["rollout_is_max"] == pytest.approx(max_, abs=1e-12)
    assert out["rollout_is_ratio_max"] == pytest.approx(4.0, abs=1e-12)
    assert out["rollout_is_capped_frac"] == 0.25
    assert [metrics[k].kind for k in metrics] == [Kind.MEAN, Kind.MAX, Kind.MAX, Kind.MEAN, Kind.MIN, Kind.DERIVED,
                                                  Kind.DERIVED]
    assert not w.requires_grad


@pytest.mark.parametrize("mode, applied", [("tis", [1.0, 2.0, 3.0, 0.5]), ("mis", [1.0, 2.0, 0.0, 0.5])])
def test_weight_min_std_and_effective_sample_size_by_hand(mode, applied):
    """tis applies [1, 2, 3, 1/2]: sum 6.5, sum of squares 14.25, n 4: std sqrt(14.25/4 - 1.625^2) = sqrt(0.921875),
    ESS 6.5^2 / (4 * 14.25) = 42.25/57; mis applies [1, 2, 0, 1/2]: sum 3.5, squares 5.25: std
    sqrt(1.3125 - 0.875^2) = sqrt(0.546875), ESS 12.25/21. Split in two halves, the pooled stats give the same."""
    from fsdptrain.rl.rollout_correction import effective_sample_size

    _, metrics = rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode=mode, level="token", cap=3.0)
    out = finalize(metrics)
    total, squares = sum(applied), sum(w * w for w in applied)
    assert out["rollout_is_min"] == min(applied)
    assert out["rollout_is_std"] == pytest.approx(math.sqrt(squares / 4 - (total / 4) ** 2), abs=1e-12)
    assert out["rollout_is_eff_sample_size"] == pytest.approx(total * total / (4 * squares), abs=1e-12)
    assert effective_sample_size([4.0, 10.0, 2.0]) == pytest.approx(0.8, abs=1e-15)  # w = [1, 3]
    assert effective_sample_size([0.0, 0.0, 2.0]) is None and effective_sample_size([0.0, 0.0, 0.0]) is None
    halves = [rollout_correction_weights(OLD[:, cols], BEHAVIOUR[:, cols], MASK[:, cols], mode=mode, level="token",
                                         cap=3.0)[1] for cols in (slice(0, 2), slice(2, 5))]
    assert finalize(merge(*halves)) == pytest.approx(out, abs=1e-12)


def test_token_metrics_merge_exactly_over_a_split():
    whole = finalize(rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="tis", level="token", cap=3.0)[1])
    a = rollout_correction_weights(OLD[:, :1], BEHAVIOUR[:, :1], MASK[:, :1], mode="tis", level="token", cap=3.0)[1]
    b = rollout_correction_weights(OLD[:, 1:], BEHAVIOUR[:, 1:], MASK[:, 1:], mode="tis", level="token", cap=3.0)[1]
    assert finalize(merge(a, b)) == whole


# sequence level, padded [3, 3]: seq 0 log-ratios [ln 2, ln 2, masked] -> w = 4; seq 1 [-ln 2, 0, 0] -> 0.5;
# seq 2 fully masked (not in the metrics)
SEQ_OLD = torch.zeros(3, 3, dtype=F64)
SEQ_BEHAVIOUR = torch.tensor([[-LN2, -LN2, 7.0], [LN2, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
SEQ_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize("mode, w0, mean", [("tis", 3.0, 3.5 / 2), ("mis", 0.0, 0.5 / 2)])
def test_sequence_level_by_hand(mode, w0, mean):
    w, metrics = rollout_correction_weights(SEQ_OLD, SEQ_BEHAVIOUR, SEQ_MASK, mode=mode, level="sequence", cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[w0, w0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    out = finalize(metrics)
    assert out["rollout_is_mean"] == pytest.approx(mean, abs=1e-12)  # sequence-weighted: 2 sequences
    assert out["rollout_is_ratio_max"] == pytest.approx(4.0, abs=1e-12)
    assert out["rollout_is_capped_frac"] == 0.5


def test_sequence_level_packed_equals_padded():
    padded, m_pad = rollout_correction_weights(SEQ_OLD, SEQ_BEHAVIOUR, SEQ_MASK, mode="tis", level="sequence", cap=3.0)
    flat_b = torch.tensor([-LN2, -LN2, 7.0, LN2, 0.0, 0.0, 5.0], dtype=F64)  # seqs 0 and 1, then a padding tail
    flat_m = torch.tensor([1, 1, 0, 1, 1, 1, 1])
    packed, m_pack = rollout_correction_weights(torch.zeros(7, dtype=F64), flat_b, flat_m, mode="tis",
                                                level="sequence", cap=3.0, cu_seqlens=torch.tensor([0, 3, 6]))
    torch.testing.assert_close(packed[:6], padded[:2].reshape(-1))
    assert packed[6] == 0.0 and finalize(m_pack) == finalize(m_pad)


def test_a_huge_ratio_is_capped_exactly():
    # log w = 100: exp would overflow fp32; the cap is decided in log space
    old = torch.tensor([[0.0]])
    w, metrics = rollout_correction_weights(old, torch.tensor([[-100.0]]), torch.ones(1, 1), mode="tis",
                                            level="token", cap=2.0)
    assert w.item() == 2.0 and finalize(metrics)["rollout_is_ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    w, _ = rollout_correction_weights(old, torch.tensor([[-100.0]]), torch.ones(1, 1), mode="mis", level="token",
                                      cap=2.0)
    assert w.item() == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="tis, mis"):
        rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="is", level="token", cap=2.0)
    with pytest.raises(ValueError, match="token, sequence"):
        rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="tis", level="seq", cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="tis", level="token", cap=0.0)


def test_weights_multiply_the_pg_term_only():
    # on-policy ratio 1, A = 1: vanilla pg = -1 per token, d/dlogp = -1; weights [2, 0.5] -> loss -2.5 (token-sum),
    # grad [-2, -0.5]; the KL term (k1, logp - ref = 1 each, coef 1) is not weighted: + 2
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, torch.ones(1, 2, dtype=F64), torch.ones(1, 2), norms=LossNormalizers(2, 1),
                          agg_mode="token-sum", clip_ratio_low=0.2, clip_ratio_high=0.2,
                          rollout_is_weights=torch.tensor([[2.0, 0.5]], dtype=F64),
                          ref_logprobs=old - 1.0, kl_coef=1.0, kl_estimator="k1")
    loss.backward()
    assert loss.item() == pytest.approx(-2.5 + 2.0, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 + 1.0, -0.5 + 1.0]], dtype=F64))


# groups: 5 -> [1, 1, 1] all equal, dropped; 2 -> [0, 1] kept; 9 -> [2] alone, dropped; 4 -> [3, 3] dropped
DS_SCORES = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0, 3.0, 3.0])
DS_GROUPS = torch.tensor([5, 5, 5, 2, 2, 9, 4, 4])


def test_dynamic_sampling_by_hand():
    keep, kept_ids, metrics = groups_with_signal(DS_SCORES, DS_GROUPS)
    assert keep.tolist() == [False, False, False, True, True, False, False, False]
    assert kept_ids.tolist() == [2]
    out = finalize(metrics)
    assert out["dynamic_sampling_filtered_frac"] == 0.75 and out["dynamic_sampling_kept_groups"] == 1.0
    # exact comparison: 0.1 + 0.2 != 0.3 in floating point, so that group has signal
    keep, _, _ = groups_with_signal(torch.tensor([0.1 + 0.2, 0.3], dtype=F64), torch.tensor([0, 0]))
    assert keep.tolist() == [True, True]


def test_dynamic_sampling_does_not_depend_on_order_or_world_size():
    perm = torch.tensor([7, 3, 0, 5, 1, 6, 4, 2])
    keep, kept_ids, metrics = groups_with_signal(DS_SCORES, DS_GROUPS)
    keep_p, kept_p, metrics_p = groups_with_signal(DS_SCORES[perm], DS_GROUPS[perm])
    assert keep_p.tolist() == keep[perm].tolist() and kept_p.tolist() == kept_ids.tolist()
    assert finalize(metrics_p) == finalize(metrics)
    # two "ranks" holding disjoint groups: the summed metrics are the whole batch's
    rank0, rank1 = [0, 1, 2, 3, 4], [5, 6, 7]
    parts = [groups_with_signal(DS_SCORES[r], DS_GROUPS[r]) for r in (rank0, rank1)]
    assert torch.cat([p[0] for p in parts]).tolist() == keep.tolist()
    assert finalize(merge(parts[0][2], parts[1][2])) == finalize(metrics)


# IcePop: mis with a lower bound L zeroes w outside [L, C]. Token weights [1, 2, 4, 0.5] with L = 0.75, C = 3:
# [1, 2, 0 (above C), 0 (below L)]; mean 3/4, max 2, share outside 2/4.
def test_mis_lower_bound_by_hand():
    w, metrics = rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="mis", level="token", cap=3.0, low=0.75)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12)
    out = finalize(metrics)
    assert out["rollout_is_mean"] == pytest.approx(3.0 / 4, abs=1e-12)
    assert out["rollout_is_max"] == pytest.approx(2.0, abs=1e-12)
    assert out["rollout_is_capped_frac"] == 0.5
    # L exactly on a weight keeps it (the interval is closed): L = 0.5 keeps the 0.5
    w, _ = rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="mis", level="token", cap=3.0, low=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.0, 0.5, 0.0]], dtype=F64), rtol=0, atol=1e-12)


def test_mis_lower_bound_at_sequence_level_by_hand():
    # seq 0: w = 4, seq 1: w = 0.5; L = 1, C = 5 keeps seq 0 and zeroes seq 1; mean over 2 sequences = 4 / 2
    w, metrics = rollout_correction_weights(SEQ_OLD, SEQ_BEHAVIOUR, SEQ_MASK, mode="mis", level="sequence", cap=5.0,
                                            low=1.0)
    torch.testing.assert_close(w, torch.tensor([[4.0, 4.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    out = finalize(metrics)
    assert out["rollout_is_mean"] == pytest.approx(2.0, abs=1e-12)
    assert out["rollout_is_capped_frac"] == 0.5


def test_a_tiny_ratio_is_masked_in_log_space():
    # log w = -100: exp of the clamped log-ratio is e^-20 > 0, but the decision log w < log L zeroes it
    w, _ = rollout_correction_weights(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), mode="mis",
                                      level="token", cap=2.0, low=1e-9)
    assert w.item() == 0.0


def test_lower_bound_bad_arguments():
    with pytest.raises(ValueError, match="applies to mode 'mis' only, not 'tis'"):
        rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="tis", level="token", cap=2.0, low=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, cap=2.0\), got 2.0"):
        rollout_correction_weights(OLD, BEHAVIOUR, MASK, mode="mis", level="token", cap=2.0, low=2.0)


def test_check_metrics_reference_weights_take_the_lower_bound():
    """check-metrics' definition-side weights (`fsdptrain.check.reference`) zero what lies outside [L, C] too."""
    from fsdptrain.check.batch import IsCorrection
    from fsdptrain.check.reference import reference_is_metrics, reference_is_weights

    old, behaviour = OLD[0, :4], BEHAVIOUR[0, :4]
    applied, raw = reference_is_weights(old, behaviour, IsCorrection("mis", "token", 3.0, 0.75))
    torch.testing.assert_close(applied, torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=F64), rtol=0, atol=1e-12)
    metrics = reference_is_metrics([old], [behaviour], IsCorrection("mis", "token", 3.0, 0.75))
    assert metrics["experience/rollout_is_capped_frac"] == 0.5


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gmpo_takes_the_geometric_mean_of_a_sequences_weights(layout):
    """issue 29's example: on-policy r = 1, A = 1, token weights [0.5, 2] -> geomean sqrt(0.5 * 2) = 1, loss -1.0
    (the arithmetic mean 1.25 gave -1.25); gradient -A R w_geo / c = -1/2 per token under seq-mean-token-mean. A third,
    masked token with weight 9 changes nothing."""
    from fsdptrain.rl.pg_terms import gmpo_policy_loss

    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    weights = torch.tensor([[0.5, 2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    cu = None
    if layout == "packed":
        old, weights, mask, cu = old[0], weights[0], torch.tensor([1, 1, 1]), torch.tensor([0, 2])
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, torch.ones_like(old), mask, norms=LossNormalizers(2, 1),
                          agg_mode="seq-mean-token-mean", clip_ratio_low=0.4, clip_ratio_high=0.4,
                          pg_loss_fn=gmpo_policy_loss, rollout_is_weights=weights, cu_seqlens=cu)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)
    torch.testing.assert_close(logp.grad.reshape(-1)[:2], torch.tensor([-0.5, -0.5], dtype=F64), rtol=0, atol=1e-12)


def test_gmpo_weights_by_hand_zero_and_unequal():
    """w = [0.25, 1] -> geomean 0.5 on both tokens; a mis-zeroed token zeroes its sequence; vanilla keeps w_t."""
    from fsdptrain.rl.aggregate import SeqLayout
    from fsdptrain.rl.pg_terms import gmpo_policy_loss, vanilla_policy_loss, weigh_by_rollout_is

    layout = SeqLayout((2, 2), None, torch.device("cpu"))
    valid = torch.ones(2, 2, dtype=torch.bool)
    pg = torch.ones(2, 2, dtype=F64)
    w = torch.tensor([[0.25, 1.0], [0.0, 4.0]], dtype=F64)
    geo = weigh_by_rollout_is(pg, w, valid, layout=layout, pg_loss_fn=gmpo_policy_loss)
    torch.testing.assert_close(geo, torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12)
    assert torch.equal(weigh_by_rollout_is(pg, w, valid, layout=layout, pg_loss_fn=vanilla_policy_loss), w)


def test_off_policy_diagnostics_by_hand():
    """SEQ_*: d = behaviour - old = [-ln2, -ln2] (seq 0), [ln2, 0, 0] (seq 1), seq 2 masked.
    k1: (-2 ln2 + ln2) / 5; k3 = e^-d + d - 1: 2 (1 - ln2) + (ln2 - 1/2) + 0 + 0 = 3/2 - ln2, / 5;
    log-ppl gap per sequence: -ln2 and ln2 / 3, mean -ln2 / 3; ratios w = e^-d = [2, 2], [1/2, 1, 1]: all inside the
    closed band [1/2, 2]."""
    from fsdptrain.rl.rollout_correction import off_policy_diagnostics

    metrics = off_policy_diagnostics(SEQ_OLD, SEQ_BEHAVIOUR, SEQ_MASK)
    out = finalize(metrics)
    assert out["kl_k1"] == pytest.approx(-LN2 / 5, abs=1e-12)
    assert out["kl_k3"] == pytest.approx((1.5 - LN2) / 5, abs=1e-12)
    assert out["log_ppl_diff"] == pytest.approx(-LN2 / 3, abs=1e-12)
    assert out["ratio_outside_frac"] == 0.0
    # verl's names: old log-probs 0 -> training ppl 1; behaviour means -ln2 and ln2/3 -> rollout ppl 2 and 2^(-1/3)
    assert out["training_ppl"] == 1.0 and out["training_log_ppl"] == 0.0
    assert out["rollout_ppl"] == pytest.approx((2 + 2 ** (-1 / 3)) / 2, abs=1e-12)
    assert out["rollout_log_ppl"] == pytest.approx(LN2 / 3, abs=1e-12)
    # gaps -ln2 and ln2/3: |gap| mean 2 ln2 / 3, extremes, exp(gap) mean (1/2 + 2^(1/3)) / 2
    assert out["log_ppl_abs_diff"] == pytest.approx(2 * LN2 / 3, abs=1e-12)
    assert out["log_ppl_diff_max"] == pytest.approx(LN2 / 3, abs=1e-12)
    assert out["log_ppl_diff_min"] == pytest.approx(-LN2, abs=1e-12)
    assert out["ppl_ratio"] == pytest.approx((0.5 + 2 ** (1 / 3)) / 2, abs=1e-12)
    # w^2 = 4, 4, 1/4, 1, 1: mean 2.05; sequence ratios 4 and 1/2: mean of squares 8.125
    assert out["chi2_token"] == pytest.approx(1.05, abs=1e-12)
    assert out["chi2_seq"] == pytest.approx(7.125, abs=1e-12)
    extremes = {"log_ppl_diff_max": Kind.MAX, "log_ppl_diff_min": Kind.MIN}
    assert {k: metrics[k].kind for k in metrics} == {k: extremes.get(k, Kind.MEAN) for k in metrics}
    # w = 4 (d = -2 ln2) is outside, w = e^-0.1 inside: 1/2
    out = finalize(off_policy_diagnostics(torch.zeros(1, 2, dtype=F64), torch.tensor([[-2 * LN2, 0.1]], dtype=F64),
                                          torch.ones(1, 2)))
    assert out["ratio_outside_frac"] == 0.5


def test_off_policy_diagnostics_packed_equals_padded():
    from fsdptrain.rl.rollout_correction import off_policy_diagnostics

    padded = finalize(off_policy_diagnostics(SEQ_OLD, SEQ_BEHAVIOUR, SEQ_MASK))
    flat_b = torch.tensor([-LN2, -LN2, 7.0, LN2, 0.0, 0.0, 5.0], dtype=F64)
    packed = finalize(off_policy_diagnostics(torch.zeros(7, dtype=F64), flat_b, torch.tensor([1, 1, 0, 1, 1, 1, 1]),
                                             cu_seqlens=torch.tensor([0, 3, 6])))
    assert packed == pytest.approx(padded, abs=1e-12)


def test_experience_logs_diagnostics_of_the_rollouts_that_carry_behaviour_logprobs_only():
    """Three rollouts: old [0, 0] with behaviour [-L, -L] (L = ln 1.5); old [0] with behaviour [ln 4]; old [0, 0, 0]
    with none (left out). d = [-L, -L, 2 ln2]: k1 = (2 ln2 - 2L) / 3; k3 = e^-d + d - 1 summed: 2 (1/2 - L) +
    (1/4 + 2 ln2 - 1), / 3 = (1/4 + 2 ln2 - 2L) / 3; log-ppl gap per carrying sequence -L and 2 ln2, mean
    (2 ln2 - L) / 2; ratios 1.5, 1.5 (inside [1/2, 2]), 1/4 (outside): 1/3.
    Split over two ranks the pooled totals and counts give the same numbers; none carried: absent, never 0.0."""
    from fsdptrain.metrics.typed import merge_all
    from fsdptrain.train.experience import off_policy_metrics

    old = [torch.zeros(2), torch.zeros(1), torch.zeros(3)]
    big_l = math.log(1.5)
    behaviour = [torch.tensor([-big_l, -big_l]), torch.tensor([2 * LN2]), None]
    want = {"rollout_corr/kl_k1": (2 * LN2 - 2 * big_l) / 3, "rollout_corr/kl_k3": (0.25 + 2 * LN2 - 2 * big_l) / 3,
            "rollout_corr/log_ppl_diff": (2 * LN2 - big_l) / 2, "rollout_corr/ratio_outside_frac": 1 / 3,
            # old 0: ppl 1; behaviour means -L and 2 ln2: ppl 1.5 and 1/4
            "rollout_corr/training_ppl": 1.0, "rollout_corr/training_log_ppl": 0.0,
            "rollout_corr/rollout_ppl": 0.875, "rollout_corr/rollout_log_ppl": (big_l - 2 * LN2) / 2,
            "rollout_corr/log_ppl_abs_diff": (big_l + 2 * LN2) / 2, "rollout_corr/log_ppl_diff_max": 2 * LN2,
            "rollout_corr/log_ppl_diff_min": -big_l, "rollout_corr/ppl_ratio": (2 / 3 + 4) / 2,
            # w = 1.5, 1.5, 1/4: squares 4.5625 / 3; sequence ratios 2.25 and 1/4: squares (5.0625 + 0.0625) / 2
            "rollout_corr/chi2_token": 1.5625 / 3, "rollout_corr/chi2_seq": 1.5625}
    metrics = off_policy_metrics(old, behaviour)
    assert finalize(metrics) == pytest.approx(want, rel=1e-6, abs=1e-7)  # the log-probs are fp32
    assert {m.kind for m in metrics.values()} == {Kind.MEAN, Kind.MAX, Kind.MIN}
    split = merge_all([off_policy_metrics(old[:1], behaviour[:1]), off_policy_metrics(old[1:], behaviour[1:])])
    assert finalize(split) == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert finalize(off_policy_metrics(old[2:], behaviour[2:])) == {}
    assert list(off_policy_metrics([], [])) == list(want)  # the names are fixed: the ranks' schemas agree


# ---- rejection sampling (algorithm.rollout_rejection) -----------------------------------------------------------
# d = old - behaviour: sequence 0 [0, 1, -1] (ratios 1, e, 1/e), sequence 1 [0.5, 0.5, masked NaN]; bounds [0.5, 2]
REJ_OLD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
REJ_BEHAVIOUR = torch.tensor([[0.0, -1.0, 1.0], [-0.5, -0.5, math.nan]], dtype=F64)
REJ_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


E = math.e


@pytest.mark.parametrize("level, keep, token_frac, seq_frac, ratio_mean", [
    # token: 1 kept, e and 1/e out; 1.65 kept twice -> 2 of 5 rejected
    ("token", [[1, 0, 0], [1, 1, 0]], 2 / 5, 0.0, (1 + E + 1 / E + 2 * E ** 0.5) / 5),
    # sequence: prod = e^0 = 1 kept; e^1 = 2.72 > 2 rejected whole -> 2 of 5 tokens, 1 of 2 sequences
    ("sequence", [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2, (3 + 2 * E) / 5),
    # geometric: e^0 = 1 and e^0.5 = 1.65 both kept
    ("geometric", [[1, 1, 1], [1, 1, 0]], 0.0, 0.0, (3 + 2 * E ** 0.5) / 5),
])
def test_rejection_by_hand(level, keep, token_frac, seq_frac, ratio_mean):
    kept, metrics = rollout_rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, level=level, low=0.5, high=2.0)
    assert kept.tolist() == [[bool(k) for k in row] for row in keep]
    out = finalize(metrics)
    assert out["rollout_rs_rejected_token_frac"] == pytest.approx(token_frac, abs=1e-12)
    assert out["rollout_rs_rejected_seq_frac"] == pytest.approx(seq_frac, abs=1e-12)
    assert out["rollout_rs_ratio_mean"] == pytest.approx(ratio_mean, abs=1e-12)
    assert {name: m.kind for name, m in metrics.items()} == {"rollout_rs_rejected_token_frac": Kind.MEAN,
                                                             "rollout_rs_rejected_seq_frac": Kind.MEAN,
                                                             "rollout_rs_ratio_mean": Kind.MEAN}


@pytest.mark.parametrize("level, keep", [
    ("token", [[1, 0, 0], [1, 1, 0]]),      # the tool token (ratio e) is not a policy token: never kept
    ("sequence", [[0, 0, 0], [0, 0, 0]]),   # seq 0: e^(0 - 1) = 0.37 < 0.5 over its policy tokens
    ("geometric", [[1, 0, 1], [1, 1, 0]]),  # seq 0: e^(-1/2) = 0.61 kept
])
def test_rejection_reads_the_policy_tokens_only(level, keep):
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    kept, _ = rollout_rejection_mask(REJ_OLD, REJ_BEHAVIOUR, mask, level=level, low=0.5, high=2.0)
    assert kept.tolist() == [[bool(k) for k in row] for row in keep]


def test_rejection_packed_equals_padded():
    packed_old = REJ_OLD[:, :].reshape(-1)[[0, 1, 2, 3, 4]]
    packed_behaviour = REJ_BEHAVIOUR.reshape(-1)[[0, 1, 2, 3, 4]]
    cu = torch.tensor([0, 3, 5])
    for level in ("token", "sequence", "geometric"):
        padded, m_padded = rollout_rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, level=level, low=0.5, high=2.0)
        packed, m_packed = rollout_rejection_mask(packed_old, packed_behaviour, torch.ones(5), level=level, low=0.5,
                                                  high=2.0, cu_seqlens=cu)
        assert packed.tolist() == padded[REJ_MASK.bool()].tolist()
        assert finalize(m_packed) == finalize(m_padded)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(level="turn", low=0.5, high=2.0), "unknown rollout rejection level 'turn'"),
    (dict(level="token", low=2.0, high=2.0), "need 0 < low < high"),
    (dict(level="token", low=0.0, high=2.0), "need 0 < low < high"),
])
def test_rejection_refuses_bad_settings(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        rollout_rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, **kwargs)


def test_config_refuses_a_rejection_band_upside_down():
    from fsdptrain.config.compose import compose_config
    from fsdptrain.config import ConfigError

    with pytest.raises(ConfigError, match="^algorithm.rollout_rejection_low=3.0 must be below "
                                          "algorithm.rollout_rejection_high=2.0$"):
        compose_config(["algorithm.rollout_rejection=token", "algorithm.rollout_rejection_low=3"])


def test_sequence_perplexity_by_hand():
    """logp [ln 1/2, ln 1/2] and [ln 1/4] (a masked NaN beside it): ppl (2 + 4) / 2 = 3, log_ppl 1.5 ln2; packed alike."""
    from fsdptrain.rl.rollout_correction import sequence_perplexity

    logp = torch.tensor([[-LN2, -LN2], [-2 * LN2, math.nan]], dtype=F64)
    out = finalize(sequence_perplexity(logp, torch.tensor([[1, 1], [1, 0]])))
    assert out == pytest.approx({"ppl": 3.0, "log_ppl": 1.5 * LN2}, abs=1e-12)
    packed = finalize(sequence_perplexity(torch.tensor([-LN2, -LN2, -2 * LN2], dtype=F64), torch.ones(3),
                                          cu_seqlens=torch.tensor([0, 2, 3])))
    assert packed == pytest.approx(out, abs=1e-12)


def test_token_veto_by_hand():
    """d = old - behaviour = [0, ln 1e-5] and [0, 0], threshold 1e-4: sequence 0 vetoed whole (a ratio 1e-5 < 1e-4),
    one catastrophic token of 4, one sequence of 2; a masked catastrophic token vetoes nothing."""
    from fsdptrain.rl.rollout_correction import rollout_veto_mask

    old = torch.zeros(2, 2, dtype=F64)
    behaviour = torch.tensor([[0.0, -math.log(1e-5)], [0.0, 0.0]], dtype=F64)
    keep, metrics = rollout_veto_mask(old, behaviour, torch.ones(2, 2), threshold=1e-4)
    assert keep.tolist() == [[False, False], [True, True]]
    assert finalize(metrics) == {"rollout_veto_seq_frac": 0.5, "rollout_veto_token_frac": 0.25}
    keep, metrics = rollout_veto_mask(old, behaviour, torch.tensor([[1, 0], [1, 1]]), threshold=1e-4)
    assert keep.tolist() == [[True, False], [True, True]]
    assert finalize(metrics) == {"rollout_veto_seq_frac": 0.0, "rollout_veto_token_frac": 0.0}
    with pytest.raises(ValueError, match="veto threshold must be > 0"):
        rollout_veto_mask(old, behaviour, torch.ones(2, 2), threshold=0.0)


@pytest.mark.parametrize("estimator, reduction, high, keep, token_frac, seq_frac, stat_mean", [
    # l = old - behaviour: sequence 0 [0, 1, -1], sequence 1 [0.5, 0.5] (REJ_*). k2 = l^2/2: [0, 1/2, 1/2], [1/8, 1/8]
    ("k2", "token", 0.25, [[1, 0, 0], [1, 1, 0]], 2 / 5, 0.0, (1 + 0.25) / 5),
    ("k2", "sum", 0.5, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2, (3 * 1.0 + 2 * 0.25) / 5),      # sums 1 and 1/4
    ("k2", "mean", 0.2, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2, (3 / 3 + 2 * 0.125) / 5),     # means 1/3 and 1/8
    ("k2", "max", 0.5, [[1, 1, 1], [1, 1, 0]], 0.0, 0.0, (3 * 0.5 + 2 * 0.125) / 5),       # maxes 1/2 and 1/8
    # k3 = e^l - 1 - l: [0, e - 2, 1/e], [e^0.5 - 1.5] * 2; max of sequence 0 is e - 2 = 0.718
    ("k3", "max", 0.5, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2, (3 * (E - 2) + 2 * (E ** 0.5 - 1.5)) / 5),
])
def test_divergence_rejection_by_hand(estimator, reduction, high, keep, token_frac, seq_frac, stat_mean):
    from fsdptrain.rl.rollout_correction import rollout_divergence_rejection_mask

    kept, metrics = rollout_divergence_rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, estimator=estimator,
                                                      reduction=reduction, high=high)
    assert kept.tolist() == [[bool(k) for k in row] for row in keep]
    out = finalize(metrics)
    assert out["rollout_rs_rejected_token_frac"] == pytest.approx(token_frac, abs=1e-12)
    assert out["rollout_rs_rejected_seq_frac"] == pytest.approx(seq_frac, abs=1e-12)
    assert out["rollout_rs_divergence_mean"] == pytest.approx(stat_mean, abs=1e-12)
    packed, m_packed = rollout_divergence_rejection_mask(REJ_OLD.reshape(-1)[:5], REJ_BEHAVIOUR.reshape(-1)[:5],
                                                         torch.ones(5), estimator=estimator, reduction=reduction,
                                                         high=high, cu_seqlens=torch.tensor([0, 3, 5]))
    assert packed.tolist() == kept[REJ_MASK.bool()].tolist()
    assert finalize(m_packed) == pytest.approx(out, abs=1e-12)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(estimator="k1", reduction="token", high=1.0), "unknown rejection divergence 'k1'"),
    (dict(estimator="k2", reduction="min", high=1.0), "unknown rejection reduction 'min'"),
    (dict(estimator="k2", reduction="token", high=0.0), "must be > 0"),
])
def test_divergence_rejection_refuses_bad_settings(kwargs, fragment):
    from fsdptrain.rl.rollout_correction import rollout_divergence_rejection_mask

    with pytest.raises(ValueError, match=fragment):
        rollout_divergence_rejection_mask(REJ_OLD, REJ_BEHAVIOUR, REJ_MASK, **kwargs)


@pytest.mark.parametrize("option, parsed", [("token_k2", ("k2", "token")), ("token_k3", ("k3", "token")),
                                            ("seq_sum_k2", ("k2", "sum")), ("seq_mean_k3", ("k3", "mean")),
                                            ("seq_max_k2", ("k2", "max"))])
def test_divergence_option_names_are_verl_s(option, parsed):
    from fsdptrain.rl.rollout_correction import divergence_option

    assert divergence_option(option) == parsed


def test_ratio_and_divergence_rejections_together_by_hand():
    # one sequence, d = [ln 2, 0]: ratios [2, 1] both in [0.5, 2.5]; token_k2 = [(ln 2)^2 / 2, 0] = [0.2402, 0]:
    # the divergence (max 0.1) rejects the first token only; token share 1/2, no sequence emptied;
    # ratio mean (2 + 1) / 2, divergence mean 0.2402 / 2. With the ratio band [0.5, 1.5] as well, it is still the
    # first token only (each rejection judges the same tokens; a token goes when either rejects it).
    from fsdptrain.rl.rollout_correction import RejectionSettings, rollout_rejection

    old = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    behaviour, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2)
    k2 = 0.5 * math.log(2.0) ** 2
    for high in (2.5, 1.5):
        settings = RejectionSettings("token", 0.5, high, "token_k2", 0.1)
        kept, metrics = rollout_rejection(old, behaviour, mask, settings)
        assert kept.tolist() == [[False, True]]
        assert finalize(metrics) == pytest.approx({"rollout_rs_rejected_token_frac": 0.5,
                                                   "rollout_rs_rejected_seq_frac": 0.0,
                                                   "rollout_rs_ratio_mean": 1.5,
                                                   "rollout_rs_divergence_mean": k2 / 2}, abs=1e-12)
    # the divergence alone: seq_sum_k2 of the sequence is k2 > 0.1, so both tokens go and the sequence is emptied
    kept, metrics = rollout_rejection(old, behaviour, mask, RejectionSettings(divergence="seq_sum_k2",
                                                                              divergence_max=0.1))
    assert kept.tolist() == [[False, False]]
    assert finalize(metrics) == pytest.approx({"rollout_rs_rejected_token_frac": 1.0,
                                               "rollout_rs_rejected_seq_frac": 1.0,
                                               "rollout_rs_divergence_mean": k2}, abs=1e-12)


def test_geometric_level_weights_by_hand():
    # d = [ln 2, ln 8] and [ln 1/2]: geometric means sqrt(2 * 8) = 4 and 1/2, one weight per sequence on each of its
    # tokens; tis C = 2 truncates 4 to 2. Sequence-weighted metrics: mean (2 + 1/2) / 2, max 2, min 1/2, raw max 4,
    # capped share 1/2. The same in the packed layout. The reference's definition (prod r)^(1/n) agrees.
    from fsdptrain.check.batch import IsCorrection
    from fsdptrain.check.reference import reference_is_weights

    old = torch.tensor([[math.log(2.0), math.log(8.0)], [math.log(0.5), 0.0]], dtype=torch.float64)
    behaviour, mask = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights, metrics = rollout_correction_weights(old, behaviour, mask, mode="tis", level="geometric", cap=2.0)
    assert weights.reshape(-1).tolist() == pytest.approx([2.0, 2.0, 0.5, 0.0], abs=1e-12)
    out = finalize(metrics)
    assert {k: out[k] for k in ("rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_ratio_max",
                                "rollout_is_capped_frac")} == pytest.approx(
        {"rollout_is_mean": 1.25, "rollout_is_max": 2.0, "rollout_is_min": 0.5, "rollout_is_ratio_max": 4.0,
         "rollout_is_capped_frac": 0.5}, abs=1e-12)
    packed, m_packed = rollout_correction_weights(old[mask.bool()], behaviour[mask.bool()], torch.ones(3), mode="tis",
                                                  level="geometric", cap=2.0, cu_seqlens=torch.tensor([0, 2, 3]))
    assert packed.tolist() == pytest.approx([2.0, 2.0, 0.5], abs=1e-12)
    assert finalize(m_packed) == pytest.approx(out, abs=1e-12)
    applied, raw = reference_is_weights(old[0], behaviour[0], IsCorrection("mis", "geometric", 5.0, None))
    assert applied.tolist() == pytest.approx([4.0, 4.0], abs=1e-12) and raw.tolist() == pytest.approx([4.0])
