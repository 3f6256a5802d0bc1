"""Off-policy correction: importance weights from the policy that sampled (behaviour) to the one trained (old).

When rollouts come from another engine or an older policy, the old log-probs (recomputed by the trainer's forward)
and the behaviour log-probs (reported by the sampler) differ. The PPO ratio is taken against the old policy; these
weights correct for the sampler's drift and multiply the per-token policy-gradient loss (`policy_loss(...,
rollout_is_weights=)`). They are detached: no gradient flows through them.

Legend: `_N` one value per sequence; unsuffixed tensors are per token, padded `[B, T]` or packed `[T]`/`[1, T]` with
`cu_seqlens`. Departures from verl's rollout correction: the lower threshold (IcePop's, verl's
`rollout_is_threshold_lower`) applies to mis only, and has no default (verl's is 1/C); a weight of 0 (MIS) keeps its
token in the loss's normalizers (rejection sampling, `rollout_rejection_mask`, removes it from the mask instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fsdptrain.registry.constants import LOG_RATIO_CLAMP
from fsdptrain.registry.names import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    ROLLOUT_DIVERGENCE_REJECTIONS,
    ROLLOUT_REJECTION_LEVELS,
)
from fsdptrain.rl.aggregate import SeqLayout, masked
from fsdptrain.metrics.typed import Derived, Max, Mean, Metrics, Min, std_from_moments


def rollout_correction_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str,
    cap: float,
    low: float | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Detached importance weights w (0 at invalid positions) and their metrics.

    Token level: log w_t = old_logp_t - behaviour_logp_t. Sequence level: every valid token of sequence i has
    log w_i = sum over i's valid tokens of (old_logp - behaviour_logp), the log of the product of its token ratios.
    Geometric level (verl's older `rollout_is_level="geometric"`): log w_i = that sum / n_i, per sequence likewise.
    With cap C and lower bound L (mis only; None: no lower bound):
        tis (truncated IS): w' = min(w, C);      mis (masked IS): w' = w if L <= w <= C else 0.
    mis with L is IcePop's masking (Ling team, "IcePop", 2025; verl's `rollout_is_threshold_lower`). tis takes no L:
    raising small weights to L would up-weight tokens the behaviour policy over-sampled (ValueError).
    Decisions are taken in log space (log w > log C, log w < log L), so a ratio too large (or small) for exp is still
    capped exactly; the weights themselves use exp of the log-ratio clamped to +-20.

    Metrics (token level: token-weighted over valid tokens; sequence and geometric levels: sequence-weighted over
    sequences with a valid token), all exact under any split over ranks and micro-batches:
        rollout_is_mean (MEAN), rollout_is_max (MAX): the weights w' applied;
        rollout_is_ratio_max (MAX): the raw w before the cap;
        rollout_is_capped_frac (MEAN): share with w outside [L, C] (w > C without L): truncated by tis, zeroed by
            mis;
        rollout_is_min (MIN): the smallest w' applied;
        rollout_is_std (DERIVED from sum w', sum w'^2, count): the population std of w';
        rollout_is_eff_sample_size (DERIVED, same stats): `effective_sample_size`, in (0, 1].
    Source of the last three: verl's rollout_corr metrics of the same names (verl/trainer/ppo/rollout_corr_helper.py
    `compute_is_metrics`); verl takes the ESS of the weights clamped to [L, C] with L defaulting to 1/C, here it is
    the ESS of the weights applied.
    """
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(
            f"unknown rollout correction mode {mode!r}; choose one of {', '.join(ROLLOUT_CORRECTION_MODES)}"
        )
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(
            f"unknown rollout correction level {level!r}; choose one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}"
        )
    if not cap > 0:
        raise ValueError(f"the rollout correction cap must be > 0, got {cap}")
    if low is not None and mode != "mis":
        raise ValueError(f"a rollout correction lower bound ({low}) applies to mode 'mis' only, not {mode!r}")
    if low is not None and not 0 < low < cap:
        raise ValueError(f"the rollout correction lower bound must be in (0, cap={cap}), got {low}")
    layout = SeqLayout(old_logprobs.shape, cu_seqlens, old_logprobs.device)
    valid = layout.valid(mask)
    with torch.no_grad():
        log_w = masked(old_logprobs.detach(), valid) - masked(behaviour_logprobs.detach(), valid)
        if level != "token":  # [n]: the sum of a sequence's log-ratios, or their mean (geometric)
            num_valid_N = layout.seq_sum(valid.to(torch.int64))
            log_w = layout.seq_sum(log_w) / (num_valid_N.clamp(min=1) if level == "geometric" else 1)
            unit_valid = num_valid_N > 0
        else:
            unit_valid = valid
        over = log_w > math.log(cap)
        if low is not None:
            over = over | (log_w < math.log(low))
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        capped = torch.full_like(w, cap) if mode == "tis" else torch.zeros_like(w)
        applied = torch.where(over, capped, w)
        moments = weight_moments(applied, unit_valid)
        metrics = Metrics({
            "rollout_is_mean": Mean.of(applied, unit_valid),
            "rollout_is_max": Max.of(applied, unit_valid),
            "rollout_is_ratio_max": Max.of(w, unit_valid),
            "rollout_is_capped_frac": Mean.of(over.to(w.dtype), unit_valid),
            "rollout_is_min": Min.of(applied, unit_valid),
            "rollout_is_std": Derived(moments, std_from_moments),
            "rollout_is_eff_sample_size": Derived(moments, effective_sample_size),
        })
        if level != "token":
            applied = layout.broadcast(applied)
        return masked(applied, valid), metrics


def weight_moments(w: Tensor, valid: Tensor) -> list[Tensor]:
    """[sum w, sum w^2, count] over the valid units: the additive stats of `rollout_is_std` and the ESS."""
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    kept = torch.where(valid, w, zero)
    return [kept.sum(), kept.square().sum(), valid.sum()]


def effective_sample_size(stats: list[float]) -> float | None:
    """The normalised effective sample size of importance weights from [sum w, sum w^2, count n]:

        ESS / n = (sum w)^2 / (n * sum w^2) = mean(w)^2 / mean(w^2) = 1 / mean((w / mean w)^2)

    (Kong 1992; verl's `rollout_is_eff_sample_size`): 1 when every weight is equal, 1/n when one weight carries
    everything. Example: w = [1, 3]: 16 / (2 * 10) = 0.8. None when empty or every weight is 0.
    """
    sum_w, sum_w2, count = stats
    if count <= 0 or sum_w2 <= 0.0:
        return None
    return sum_w * sum_w / (count * sum_w2)


OUTSIDE_BAND = (0.5, 2.0)
"""The ratio band of `off_policy_diagnostics`' `ratio_outside_frac`: w outside [1/2, 2]."""


def sequence_perplexity(logprobs: Tensor, mask: Tensor, *, cu_seqlens: Tensor | None = None) -> Metrics:
    """The perplexity of the sampled tokens under one policy, per sequence, averaged over the sequences with a valid
    token. With m_i = mean over i's valid tokens of logp_t:

        ppl (MEAN over sequences): exp(-m_i);      log_ppl (MEAN over sequences): -m_i.

    A sequence is never split, so each per-sequence value is whole and the pooled means are exact under any split.
    Detached. Source: verl's `training_ppl` / `rollout_ppl` and their `_log_ppl` (verl/trainer/ppo/rollout_corr_helper.py
    `compute_offpolicy_metrics`). Example: logp = [ln 1/2, ln 1/2] and [ln 1/4]: ppl (2 + 4) / 2 = 3,
    log_ppl (ln 2 + ln 4) / 2 = 1.5 ln 2.
    """
    layout = SeqLayout(logprobs.shape, cu_seqlens, logprobs.device)
    valid = layout.valid(mask)
    with torch.no_grad():
        num_tokens_N = layout.seq_sum(valid.to(torch.int64))
        mean_logp_N = layout.seq_sum(masked(logprobs.detach(), valid)) / num_tokens_N.clamp(min=1)
        seq_valid_N = num_tokens_N > 0
        return Metrics({
            "ppl": Mean.of(torch.exp(-mean_logp_N), seq_valid_N),
            "log_ppl": Mean.of(-mean_logp_N, seq_valid_N),
        })


def off_policy_diagnostics(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
) -> Metrics:
    """How far the behaviour policy (the sampler's log-probs) is from the old one (the trainer's), from the sampled
    tokens. With d_t = behaviour_logp_t - old_logp_t (the tokens were drawn from the behaviour policy):

        kl_k1 (MEAN over valid tokens): d_t, an unbiased estimate of KL(behaviour || old);
        kl_k3 (MEAN over valid tokens): exp(-d_t) + d_t - 1 >= 0, unbiased too and of lower variance (d clamped to
            +-20 inside exp);
        log_ppl_diff (MEAN over sequences with a valid token): mean_t(-old_logp) - mean_t(-behaviour_logp) per
            sequence, the gap in log-perplexity (> 0: the trainer finds the samples less likely than the sampler);
        ratio_outside_frac (MEAN over valid tokens): share of tokens whose w_t = exp(-d_t) lies outside [1/2, 2]
            (decided in log space);
        training_ppl, training_log_ppl, rollout_ppl, rollout_log_ppl (MEAN over sequences): `sequence_perplexity`
            of the old and of the behaviour log-probs;
        log_ppl_abs_diff (MEAN over sequences): |gap_i|; log_ppl_diff_max / log_ppl_diff_min (MAX / MIN over
            sequences): the extreme gaps;
        ppl_ratio (MEAN over sequences): exp(gap_i), the ratio of sequence i's trainer to sampler perplexity;
        chi2_token (MEAN over valid tokens): w_t^2 - 1, so the value is E_t[w^2] - 1, the chi-square divergence of
            the old policy from the behaviour one, per token (w_t = exp(-d_t), d clamped to +-20);
        chi2_seq (MEAN over sequences): W_i^2 - 1 with W_i = exp(-sum_t d_t) the sequence's ratio (the sum clamped
            to +-20), so the value is E_i[W^2] - 1.
    Each MEAN holds a total and a count of additive per-unit statistics: kl_k1, kl_k3 and ratio_outside_frac
    sum per-token values over the valid tokens and divide by their count; log_ppl_diff sums per-sequence gaps over the
    sequences with a valid token and divides by their count (a sequence is never split, so each gap is whole).
    Merging pools the totals and counts, so the value over a step is the token-mean (sequence-mean) over all of its
    tokens (sequences), never a mean of per-micro-batch or per-rank means: exact under any packing, micro-batching
    and split over ranks. A token-mean of the log-perplexity gap would be kl_k1 itself; verl's is per sequence.
    Extremes (MIN/MAX) are exact too. Detached. Source: verl's rollout_corr/ metrics (`kl`, `k3_kl`, `log_ppl_diff`
    and the names above, verl/trainer/ppo/rollout_corr_helper.py `compute_offpolicy_metrics`); the band share is this
    project's. The trainer logs them as `rollout_corr/*` (fsdptrain/train/experience.py `off_policy_metrics`).
    """
    layout = SeqLayout(old_logprobs.shape, cu_seqlens, old_logprobs.device)
    valid = layout.valid(mask)
    with torch.no_grad():
        old = masked(old_logprobs.detach(), valid)
        behaviour = masked(behaviour_logprobs.detach(), valid)
        d = behaviour - old
        d_clamped = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(-d_clamped) + d_clamped - 1.0
        num_tokens_N = layout.seq_sum(valid.to(torch.int64))
        seq_valid_N = num_tokens_N > 0
        gap_N = layout.seq_sum(behaviour - old) / num_tokens_N.clamp(min=1)
        low, high = OUTSIDE_BAND
        outside = (d > -math.log(low)) | (d < -math.log(high))
        seq_log_ratio_N = layout.seq_sum(old - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return Metrics({
            "kl_k1": Mean.of(d, valid),
            "kl_k3": Mean.of(k3, valid),
            "log_ppl_diff": Mean.of(gap_N, seq_valid_N),
            "ratio_outside_frac": Mean.of(outside.to(d.dtype), valid),
            **sequence_perplexity(old, valid, cu_seqlens=cu_seqlens).prefixed("training_"),
            **sequence_perplexity(behaviour, valid, cu_seqlens=cu_seqlens).prefixed("rollout_"),
            "log_ppl_abs_diff": Mean.of(gap_N.abs(), seq_valid_N),
            "log_ppl_diff_max": Max.of(gap_N, seq_valid_N),
            "log_ppl_diff_min": Min.of(gap_N, seq_valid_N),
            "ppl_ratio": Mean.of(torch.exp(gap_N.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), seq_valid_N),
            "chi2_token": Mean.of(torch.exp(-2.0 * d_clamped) - 1.0, valid),
            "chi2_seq": Mean.of(torch.exp(2.0 * seq_log_ratio_N) - 1.0, seq_valid_N),
        })


def rollout_rejection_mask(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str,
    low: float,
    high: float,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Rejection sampling: the mask with the tokens (or whole sequences) whose importance ratio falls outside
    [low, high] turned off, and its metrics. Detached; a rejected token leaves the loss and its normalisers exactly
    as a masked one.

    With d_t = old_logp_t - behaviour_logp_t over the valid tokens t of sequence i (n_i of them):
        token:     r_t = exp(d_t), each token on its own;
        sequence:  r_i = exp(sum_t d_t), the product of the token ratios, for every token of i;
        geometric: r_i = exp(sum_t d_t / n_i), their geometric mean, for every token of i;
    a unit is kept iff low <= r <= high, decided in log space (log low <= d <= log high), so no ratio overflows.
    Source: verl's rollout rejection sampling (`rollout_rs` = token / sequence / geometric,
    `rollout_rs_threshold`, `rollout_rs_threshold_lower` in verl/trainer/ppo/rollout_corr_helper.py,
    `compute_rollout_rejection_mask`); departures: both bounds are required (verl's lower defaults to 1/upper), and
    the metrics are the two shares below (verl logs more statistics of the ratios).

    Metrics (exact under any split over ranks and micro-batches):
        rollout_rs_rejected_token_frac (MEAN over valid tokens): share of the valid tokens rejected;
        rollout_rs_rejected_seq_frac (MEAN over sequences with a valid token): share left with no valid token;
        rollout_rs_ratio_mean (MEAN over valid tokens): the ratio r each token was judged by (a sequence's r on each
            of its tokens; exp of log r clamped to +-20), verl's `rollout_rs_mean`.
    """
    if level not in ROLLOUT_REJECTION_LEVELS:
        raise ValueError(f"unknown rollout rejection level {level!r}; choose one of "
                         f"{', '.join(ROLLOUT_REJECTION_LEVELS)}")
    return rollout_rejection(old_logprobs, behaviour_logprobs, mask, RejectionSettings(level, low, high),
                             cu_seqlens=cu_seqlens)


def _log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, valid: Tensor) -> Tensor:
    """d = old_logp - behaviour_logp in float64, 0 where not valid."""
    return masked(old_logprobs.detach().double(), valid) - masked(behaviour_logprobs.detach().double(), valid)


def _ratio_judgement(d: Tensor, valid: Tensor, layout: SeqLayout, *, level: str, low: float, high: float
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """Which tokens the ratio rejection keeps (see :func:`rollout_rejection_mask`) and the ratio each was judged by."""
    num_valid_N = layout.seq_sum(valid.to(torch.int64))
    if level == "token":
        log_r = d
    else:
        log_r_N = layout.seq_sum(d)
        if level == "geometric":
            log_r_N = log_r_N / num_valid_N.clamp(min=1)
        log_r = layout.broadcast(log_r_N)
    inside = (log_r >= math.log(low)) & (log_r <= math.log(high))
    return inside, {"rollout_rs_ratio_mean": torch.exp(log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))}


def _rejected(valid: Tensor, inside: Tensor, layout: SeqLayout, *, judged_by: dict[str, Tensor],
              ) -> tuple[Tensor, Metrics]:
    """The kept mask (valid and inside) and a rejection's metrics: the shares of valid tokens rejected and of
    sequences with a valid token left with none (MEAN), and the MEAN over valid tokens of each statistic the tokens
    were judged by."""
    keep = valid & inside
    seq_valid_N = layout.seq_sum(valid.to(torch.int64)) > 0
    emptied_N = seq_valid_N & (layout.seq_sum(keep.to(torch.int64)) == 0)
    return keep, Metrics({
        "rollout_rs_rejected_token_frac": Mean.of((valid & ~inside).to(torch.float64), valid),
        "rollout_rs_rejected_seq_frac": Mean.of(emptied_N.to(torch.float64), seq_valid_N),
        **{name: Mean.of(stat, valid) for name, stat in judged_by.items()},
    })


def rollout_veto_mask(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    threshold: float,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """The token veto: the mask with every sequence that holds a catastrophic token turned off, and its metrics.

    A valid token t is catastrophic when its ratio r_t = exp(old_logp_t - behaviour_logp_t) < threshold (decided in
    log space: d_t < log threshold); a sequence with one such token leaves the loss whole, as a masked one. Detached.
    Source: verl's `rollout_token_veto_threshold` (verl/trainer/ppo/rollout_corr_helper.py,
    `compute_rollout_correction_and_rejection_mask`, step 4). Example: d = [0, ln 1e-5] and [0, 0], threshold 1e-4:
    the first sequence is vetoed, token share 1/4, sequence share 1/2.

    Metrics (exact under any split over ranks and micro-batches):
        rollout_veto_seq_frac (MEAN over sequences with a valid token): share vetoed (verl's
            `rollout_is_veto_fraction`, which counts every row);
        rollout_veto_token_frac (MEAN over valid tokens): share of catastrophic tokens (verl's
            `rollout_is_catastrophic_token_fraction`).
    """
    if not threshold > 0:
        raise ValueError(f"the rollout veto threshold must be > 0, got {threshold}")
    layout = SeqLayout(old_logprobs.shape, cu_seqlens, old_logprobs.device)
    valid = layout.valid(mask)
    with torch.no_grad():
        d = masked(old_logprobs.detach().double(), valid) - masked(behaviour_logprobs.detach().double(), valid)
        catastrophic = valid & (d < math.log(threshold))
        vetoed_N = layout.seq_sum(catastrophic.to(torch.int64)) > 0
        seq_valid_N = layout.seq_sum(valid.to(torch.int64)) > 0
        keep = valid & ~layout.broadcast(vetoed_N)
        return keep, Metrics({
            "rollout_veto_seq_frac": Mean.of(vetoed_N.to(torch.float64), seq_valid_N),
            "rollout_veto_token_frac": Mean.of(catastrophic.to(torch.float64), valid),
        })


def _seq_max_of_nonnegative(layout: SeqLayout, x: Tensor) -> Tensor:
    """Per-sequence max `[n]` of a token tensor >= 0 that is 0 where not valid (a sequence with none: 0)."""
    if not layout.packed:
        return x.amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[0])
    out = torch.zeros(layout.num_seqs + 1, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, layout.seq_index_T, x.reshape(-1), reduce="amax")[: layout.num_seqs]


DIVERGENCE_ESTIMATORS = ("k2", "k3")
DIVERGENCE_REDUCTIONS = ("token", "sum", "mean", "max")


def rollout_divergence_rejection_mask(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    estimator: str,
    reduction: str,
    high: float,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Rejection by a divergence: the mask with the tokens (or whole sequences) whose divergence between the old and
    the behaviour policy exceeds `high` turned off, and its metrics. Detached; a rejected token leaves the loss and
    its normalisers exactly as a masked one.

    With l_t = old_logp_t - behaviour_logp_t (clamped to +-20) over the valid tokens t of sequence i (n_i of them):
        k2:  k_t = l_t^2 / 2;            k3:  k_t = exp(l_t) - 1 - l_t      (both >= 0, 0 iff the policies agree);
        token: each token judged by k_t;  sum / mean / max: every token of i judged by sum_t k_t, sum_t k_t / n_i,
        max_t k_t;
    a unit is kept iff its statistic <= high. Source: verl's divergence rejection options (`rollout_rs=token_k2`,
    `token_k3`, `seq_sum_k2`, `seq_sum_k3`, `seq_mean_k2`, `seq_mean_k3`, `seq_max_k2`, `seq_max_k3` with an upper
    `rollout_rs_threshold`, verl/trainer/ppo/rollout_corr_helper.py `compute_rollout_rejection_mask`).
    Example: l = [ln 2, 0] and [0, 0], k3, mean, high 0.1: k3 = [1 - ln 2, 0] = [0.307, 0], mean 0.153 > 0.1, so
    sequence 0 is rejected.

    Metrics (exact under any split over ranks and micro-batches):
        rollout_rs_rejected_token_frac, rollout_rs_rejected_seq_frac (MEAN): as `rollout_rejection_mask`'s;
        rollout_rs_divergence_mean (MEAN over valid tokens): the statistic each token was judged by (verl's
            `rollout_rs_<option>_mean`).
    """
    if estimator not in DIVERGENCE_ESTIMATORS:
        raise ValueError(f"unknown rejection divergence {estimator!r}; choose one of {', '.join(DIVERGENCE_ESTIMATORS)}")
    if reduction not in DIVERGENCE_REDUCTIONS:
        raise ValueError(f"unknown rejection reduction {reduction!r}; choose one of {', '.join(DIVERGENCE_REDUCTIONS)}")
    option = f"{'token' if reduction == 'token' else 'seq_' + reduction}_{estimator}"
    return rollout_rejection(old_logprobs, behaviour_logprobs, mask,
                             RejectionSettings(divergence=option, divergence_max=high), cu_seqlens=cu_seqlens)


def _divergence_judgement(d: Tensor, valid: Tensor, layout: SeqLayout, *, estimator: str, reduction: str,
                          high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Which tokens the divergence rejection keeps (see :func:`rollout_divergence_rejection_mask`) and the statistic
    each was judged by."""
    log_r = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k = masked(0.5 * log_r.square() if estimator == "k2" else torch.expm1(log_r) - log_r, valid)
    if reduction == "token":
        stat = k
    elif reduction == "max":
        stat = layout.broadcast(_seq_max_of_nonnegative(layout, k))
    else:
        stat_N = layout.seq_sum(k)
        if reduction == "mean":
            stat_N = stat_N / layout.seq_sum(valid.to(torch.int64)).clamp(min=1)
        stat = layout.broadcast(stat_N)
    return stat <= high, {"rollout_rs_divergence_mean": stat}


def divergence_option(option: str) -> tuple[str, str]:
    """verl's divergence option name (`algorithm.rollout_rejection_divergence`) as (estimator, reduction):
    token_k2 -> (k2, token), seq_sum_k3 -> (k3, sum), seq_mean_k2 -> (k2, mean), seq_max_k3 -> (k3, max)."""
    if option not in ROLLOUT_DIVERGENCE_REJECTIONS:
        raise ValueError(f"unknown divergence rejection {option!r}; choose one of "
                         f"{', '.join(ROLLOUT_DIVERGENCE_REJECTIONS)}")
    head, estimator = option.rsplit("_", 1)
    return estimator, "token" if head == "token" else head.removeprefix("seq_")


@dataclass(frozen=True)
class RejectionSettings:
    """The rejections `algorithm.rollout_rejection*` turn on: by ratio (``level`` token, sequence, geometric or
    none, kept in [``low``, ``high``]) and by divergence (``divergence``, one of verl's option names or none, kept
    at most ``divergence_max``)."""

    level: str = "none"
    low: float = 0.5
    high: float = 2.0
    divergence: str = "none"
    divergence_max: Optional[float] = None

    @property
    def active(self) -> bool:
        return self.level != "none" or self.divergence != "none"


def rollout_rejection(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    settings: RejectionSettings,
    *,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Every rejection ``settings`` turn on, each judged on the same valid tokens of ``mask`` (the ratio one as
    :func:`rollout_rejection_mask`, the divergence one as :func:`rollout_divergence_rejection_mask`); a token is kept
    iff every one keeps it, as verl keeps a token only when each of its comma-chained `rollout_rs` options passes.
    Detached.

    Metrics (exact under any split over ranks and micro-batches): rollout_rs_rejected_token_frac and
    rollout_rs_rejected_seq_frac (MEAN) of the combined mask, as each function's; rollout_rs_ratio_mean and
    rollout_rs_divergence_mean (MEAN over valid tokens) of the rejections that are on. Example: d = [ln 2, 0] on one
    sequence, token ratios kept in [0.5, 2.5] and token_k2 at most 0.1: k2 = [0.240, 0], so the first token is
    rejected by the divergence only; token share 1/2, sequence share 0.
    """
    if not settings.active:
        raise ValueError("rollout_rejection needs a ratio level or a divergence option")
    if settings.level != "none" and settings.level not in ROLLOUT_REJECTION_LEVELS:
        raise ValueError(f"unknown rollout rejection level {settings.level!r}; choose one of "
                         f"none, {', '.join(ROLLOUT_REJECTION_LEVELS)}")
    if settings.level != "none" and not 0 < settings.low < settings.high:
        raise ValueError(f"the rollout rejection bounds need 0 < low < high, got low={settings.low}, "
                         f"high={settings.high}")
    if settings.divergence != "none" and not (settings.divergence_max is not None and settings.divergence_max > 0):
        raise ValueError(f"the divergence rejection bound must be > 0, got {settings.divergence_max}")
    layout = SeqLayout(old_logprobs.shape, cu_seqlens, old_logprobs.device)
    valid = layout.valid(mask)
    with torch.no_grad():
        d = _log_ratio(old_logprobs, behaviour_logprobs, valid)
        inside, judged_by = torch.ones_like(valid), {}
        if settings.level != "none":
            kept, stats = _ratio_judgement(d, valid, layout, level=settings.level, low=settings.low,
                                           high=settings.high)
            inside, judged_by = inside & kept, {**judged_by, **stats}
        if settings.divergence != "none":
            estimator, reduction = divergence_option(settings.divergence)
            kept, stats = _divergence_judgement(d, valid, layout, estimator=estimator, reduction=reduction,
                                                high=settings.divergence_max)
            inside, judged_by = inside & kept, {**judged_by, **stats}
        return _rejected(valid, inside, layout, judged_by=judged_by)
