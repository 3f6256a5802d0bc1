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

import torch
from torch import Tensor

from fsdptrain.registry.constants import LOG_RATIO_CLAMP
from fsdptrain.registry.names import ROLLOUT_CORRECTION_LEVELS, ROLLOUT_CORRECTION_MODES, ROLLOUT_REJECTION_LEVELS
from fsdptrain.rl.aggregate import SeqLayout, masked
from fsdptrain.rl.metrics import Max, Mean, Metrics


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
    With cap C and lower bound L (mis only; None: no lower bound):
        tis (truncated IS): w' = min(w, C);      mis (masked IS): w' = w if L <= w <= C else 0.
    mis with L is IcePop's masking (Ling team, "IcePop", 2025; verl's `rollout_is_threshold_lower`). tis takes no L:
    raising small weights to L would up-weight tokens the behaviour policy over-sampled (ValueError).
    Decisions are taken in log space (log w > log C, log w < log L), so a ratio too large (or small) for exp is still
    capped exactly; the weights themselves use exp of the log-ratio clamped to +-20.

    Metrics (token level: token-weighted over valid tokens; sequence level: sequence-weighted over sequences with a
    valid token), all exact under any split over ranks and micro-batches:
        rollout_is_mean (MEAN), rollout_is_max (MAX): the weights w' applied;
        rollout_is_ratio_max (MAX): the raw w before the cap;
        rollout_is_capped_frac (MEAN): share with w outside [L, C] (w > C without L): truncated by tis, zeroed by
            mis.
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
        if level == "sequence":
            log_w = layout.seq_sum(log_w)  # [n]
            unit_valid = layout.seq_sum(valid.to(torch.int64)) > 0
        else:
            unit_valid = valid
        over = log_w > math.log(cap)
        if low is not None:
            over = over | (log_w < math.log(low))
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        capped = torch.full_like(w, cap) if mode == "tis" else torch.zeros_like(w)
        applied = torch.where(over, capped, w)
        metrics = Metrics({
            "rollout_is_mean": Mean.of(applied, unit_valid),
            "rollout_is_max": Max.of(applied, unit_valid),
            "rollout_is_ratio_max": Max.of(w, unit_valid),
            "rollout_is_capped_frac": Mean.of(over.to(w.dtype), unit_valid),
        })
        if level == "sequence":
            applied = layout.broadcast(applied)
        return masked(applied, valid), metrics


OUTSIDE_BAND = (0.5, 2.0)
"""The ratio band of `off_policy_diagnostics`' `ratio_outside_frac`: w outside [1/2, 2]."""


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
            (decided in log space).
    Each is a MEAN holding a total and a count of additive per-unit statistics: kl_k1, kl_k3 and ratio_outside_frac
    sum per-token values over the valid tokens and divide by their count; log_ppl_diff sums per-sequence gaps over the
    sequences with a valid token and divides by their count (a sequence is never split, so each gap is whole).
    Merging pools the totals and counts, so the value over a step is the token-mean (sequence-mean) over all of its
    tokens (sequences), never a mean of per-micro-batch or per-rank means: exact under any packing, micro-batching
    and split over ranks. A token-mean of the log-perplexity gap would be kl_k1 itself; verl's is per sequence.
    Detached. Source: verl's rollout_corr/ metrics (`kl`, `k3_kl`, `log_ppl_diff`); the band share is this
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
        return Metrics({
            "kl_k1": Mean.of(d, valid),
            "kl_k3": Mean.of(k3, valid),
            "log_ppl_diff": Mean.of(gap_N, seq_valid_N),
            "ratio_outside_frac": Mean.of(outside.to(d.dtype), valid),
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
        rollout_rs_rejected_seq_frac (MEAN over sequences with a valid token): share left with no valid token.
    """
    if level not in ROLLOUT_REJECTION_LEVELS:
        raise ValueError(f"unknown rollout rejection level {level!r}; choose one of "
                         f"{', '.join(ROLLOUT_REJECTION_LEVELS)}")
    if not 0 < low < high:
        raise ValueError(f"the rollout rejection bounds need 0 < low < high, got low={low}, high={high}")
    layout = SeqLayout(old_logprobs.shape, cu_seqlens, old_logprobs.device)
    valid = layout.valid(mask)
    with torch.no_grad():
        d = masked(old_logprobs.detach().double(), valid) - masked(behaviour_logprobs.detach().double(), valid)
        num_valid_N = layout.seq_sum(valid.to(torch.int64))
        if level == "token":
            log_r = d
        else:
            log_r_N = layout.seq_sum(d)
            if level == "geometric":
                log_r_N = log_r_N / num_valid_N.clamp(min=1)
            log_r = layout.broadcast(log_r_N)
        inside = (log_r >= math.log(low)) & (log_r <= math.log(high))
        keep = valid & inside
        seq_valid_N = num_valid_N > 0
        emptied_N = seq_valid_N & (layout.seq_sum(keep.to(torch.int64)) == 0)
        metrics = Metrics({
            "rollout_rs_rejected_token_frac": Mean.of((valid & ~inside).to(torch.float64), valid),
            "rollout_rs_rejected_seq_frac": Mean.of(emptied_N.to(torch.float64), seq_valid_N),
        })
        return keep, metrics
