"""check-metrics, part 2: the reference. One sequence at a time, unpacked, every number computed directly.

Legend: `_R` one sequence's response tokens; `_A` every valid token of the mini-batch, back to back.

Each sequence runs alone through the unpacked model on sdpa (the naive full log-softmax of
:func:`~fsdptrain.check.per_sequence.reference_policy_outputs`), and its share of the mini-batch loss is written out here from
the contract of docs/loss.md with the batch's own counts N (counted response tokens) and S (sequences with a counted
token), then backward, one sequence at a time. The counted tokens are the batch's ``counted`` masks, read from the
rollouts and the reference's own rejection (:func:`fsdptrain.check.batch.reference_counted`), never the product's
packed mask: each sequence's per-token values are taken at its counted tokens only (a tool's token, a rejected one
are dropped before anything is summed):

    token-mean  sum_t L / N;   token-sum  sum_t L;   seq-mean-token-sum  sum_t L / S;
    seq-mean-token-sum-norm  sum_t L / S / factor;   seq-mean-token-mean  mean_t L / S.

Its metrics are taken directly over all valid tokens of the batch (a min is the min of every valid value, a
token-weighted mean a plain sum over a count, the explained variance from the whole vectors), never through
``agg_loss``, the ``Metric`` merges or the rank reduction that the layouts use, so a bug there cannot hide in both.
The per-token formulas (PPO clip, dual clip, GSPO ratio, the KL estimators, clipped value error) are written here
from their definitions; the entropy is reused from ``fsdptrain.rl.policy_loss``. A policy loss other than vanilla PPO (a
built-in or a user's) runs its own per-token function on each sequence alone, its metrics merged over sequences;
the rollout-correction weights, written here from their definitions (:func:`reference_is_weights`), multiply the
per-token pg term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.check.batch import IsCorrection, RolloutFacts
from fsdptrain.check.moe_reference import DirectMoe
from fsdptrain.check.per_sequence import reference_values, sequence_outputs
from fsdptrain.registry.constants import LOG_RATIO_CLAMP
from fsdptrain.rl.aggregate import SeqLayout
from fsdptrain.metrics.typed import finalize, merge_all
from fsdptrain.rl.fused_loss import ValueLossSettings
from fsdptrain.rl.moe_aux_loss import MoeNormalizers
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.step import MiniBatch

EV_DEGENERATE = 1e-10  # Var(R) below this fraction of E[R^2]: explained variance is ill-conditioned, not compared


@dataclass(frozen=True)
class Counts:
    """N: counted response tokens of the mini-batch; S: sequences with at least one; the -norm factor."""

    num_tokens: int
    num_seqs: int
    loss_scale_factor: float

    @staticmethod
    def of(masks: Sequence[Sequence[bool]], loss_scale_factor: float) -> "Counts":
        """From each sequence's counted tokens (``CheckBatch.counted_masks``)."""
        lengths = [sum(bool(m) for m in mask) for mask in masks]
        return Counts(sum(lengths), sum(1 for n in lengths if n > 0), loss_scale_factor)


def seq_share(x_R: Tensor, mode: str, counts: Counts) -> Tensor:
    """One sequence's share of the mini-batch scalar for the per-token values ``x_R`` (float64; 0 if empty)."""
    if x_R.numel() == 0:
        return x_R.new_zeros((), dtype=torch.float64)
    x = x_R.to(torch.float64)
    if mode == "token-mean":
        return x.sum() / counts.num_tokens
    if mode == "token-sum":
        return x.sum()
    if mode == "seq-mean-token-sum":
        return x.sum() / counts.num_seqs
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / counts.num_seqs / counts.loss_scale_factor
    if mode == "seq-mean-token-mean":
        return x.mean() / counts.num_seqs
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def reference_is_weights(old_R: Tensor, behaviour_R: Tensor, correction: IsCorrection,
                         policy: Optional[Sequence[bool]] = None) -> tuple[Tensor, Tensor]:
    """One sequence's importance weights from their definitions, in float64, over its policy tokens (``policy``;
    None: every token): ``(applied w'_P, raw w)``, one applied weight per policy token.

    Token level: w_t = pi_old(y_t) / pi_behaviour(y_t) = exp(old_t - behaviour_t), raw ``[P]``. Sequence level:
    w = prod_t w_t, the product of the token ratios (one raw weight, ``[1]``), on every token; geometric level:
    w = (prod_t w_t)^(1/P), their geometric mean, likewise. tis: w' = min(w, C);
    mis: w' = w if L <= w <= C else 0 (L = 0 without a lower bound). No clamp, no log-space decision: the definitions, not the product's
    ``rollout_correction_weights``.
    """
    keep = policy if policy is not None else [True] * old_R.numel()
    ratios = [math.exp(o - b) for o, b, k in zip(old_R.double().tolist(), behaviour_R.double().tolist(), keep) if k]
    ratios_R = torch.tensor(ratios, dtype=torch.float64)
    raw = ratios_R if correction.level == "token" else torch.prod(ratios_R).reshape(1)
    if correction.level == "geometric":
        raw = raw.pow(1.0 / len(ratios))
    cap = torch.tensor(correction.cap, dtype=torch.float64)
    applied = torch.minimum(raw, cap) if correction.mode == "tis" else torch.where(_outside(raw, correction), 0.0, raw)
    return (applied if correction.level == "token" else applied.expand(len(ratios))), raw


def reference_is_metrics(olds: Sequence[Tensor], behaviours: Sequence[Tensor], correction: IsCorrection,
                         policy_masks: Optional[Sequence[Sequence[bool]]] = None) -> dict[str, float]:
    """``experience/rollout_is_*`` straight from the definitions over every valid unit of the batch (policy tokens at
    token level, sequences with a policy token at sequence level): the plain mean, max and min of the applied
    weights, their population std and normalised effective sample size (sum w)^2 / (n sum w^2), the max of the raw
    ones and the share of raw weights outside [L, C]."""
    raw_U, applied_U = [], []
    policy_masks = policy_masks if policy_masks is not None else [[True] * o.numel() for o in olds]
    for old_R, behaviour_R, policy in zip(olds, behaviours, policy_masks):
        if not any(policy):
            continue
        applied, raw = reference_is_weights(old_R, behaviour_R, correction, policy)
        raw_U.append(raw)
        applied_U.append(applied if correction.level == "token" else applied[:1])
    raw, applied = torch.cat(raw_U), torch.cat(applied_U)
    n, mean = applied.numel(), float(applied.sum() / applied.numel())
    out = {"experience/rollout_is_mean": mean,
           "experience/rollout_is_max": float(applied.max()),
           "experience/rollout_is_ratio_max": float(raw.max()),
           "experience/rollout_is_capped_frac": float(_outside(raw, correction).sum() / raw.numel()),
           "experience/rollout_is_min": float(applied.min()),
           "experience/rollout_is_std": math.sqrt(sum((float(a) - mean) ** 2 for a in applied) / n)}
    squares = float(applied.square().sum())
    if squares > 0:
        out["experience/rollout_is_eff_sample_size"] = float(applied.sum()) ** 2 / (n * squares)
    return out


def reference_off_policy_metrics(olds: Sequence[Tensor], behaviours: Sequence[Optional[Tensor]],
                                 policy_masks: Sequence[Sequence[bool]]) -> dict[str, float]:
    """``rollout_corr/*`` straight from the definitions in float64 over every policy token (``policy_masks[i]``) of
    the batch whose sequence carried behaviour log-probs (``behaviours[i]`` None: left out), with d = behaviour_logp - old_logp:
    the plain means of d (``kl_k1``), of exp(-d) + d - 1 (``kl_k3``, no clamp), of [exp(-d) < 1/2 or > 2]
    (``ratio_outside_frac``, decided on the ratio itself) and of exp(-2 d) - 1 (``chi2_token``, no clamp); and over
    those sequences, with m_old and m_b the means of their old and behaviour log-probs and gap = m_b - m_old: the
    plain means of gap (``log_ppl_diff``), |gap|, exp(gap) (``ppl_ratio``), exp(-m_old), -m_old, exp(-m_b), -m_b
    (``training_ppl``, ``training_log_ppl``, ``rollout_ppl``, ``rollout_log_ppl``) and exp(2 s) - 1 with s = -sum d
    clamped to +-20 as the metric's definition clamps it (``chi2_seq``), and the largest and smallest gap. Empty
    when no such token exists."""
    d_A: list[float] = []
    seqs: list[tuple[float, float, float]] = []  # (m_old, m_b, s) per sequence
    for old_R, behaviour_R, mask in zip(olds, behaviours, policy_masks):
        if behaviour_R is None or old_R.numel() == 0:
            continue
        pairs = [(o, b) for o, b, m in zip(old_R.double().tolist(), behaviour_R.double().tolist(), mask) if m]
        if not pairs:
            continue
        d = [b - o for o, b in pairs]
        d_A += d
        seqs.append((sum(o for o, _ in pairs) / len(pairs), sum(b for _, b in pairs) / len(pairs),
                     min(max(-sum(d), -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)))
    if not d_A:
        return {}
    n, num_seqs = len(d_A), len(seqs)
    gaps = [m_b - m_old for m_old, m_b, _ in seqs]

    def seq_mean(values) -> float:
        return sum(values) / num_seqs

    return {"rollout_corr/kl_k1": sum(d_A) / n,
            "rollout_corr/kl_k3": sum(math.exp(-x) + x - 1.0 for x in d_A) / n,
            "rollout_corr/log_ppl_diff": seq_mean(gaps),
            "rollout_corr/ratio_outside_frac": sum(not 0.5 <= math.exp(-x) <= 2.0 for x in d_A) / n,
            "rollout_corr/training_ppl": seq_mean(math.exp(-m) for m, _, _ in seqs),
            "rollout_corr/training_log_ppl": seq_mean(-m for m, _, _ in seqs),
            "rollout_corr/rollout_ppl": seq_mean(math.exp(-m) for _, m, _ in seqs),
            "rollout_corr/rollout_log_ppl": seq_mean(-m for _, m, _ in seqs),
            "rollout_corr/log_ppl_abs_diff": seq_mean(abs(g) for g in gaps),
            "rollout_corr/log_ppl_diff_max": max(gaps),
            "rollout_corr/log_ppl_diff_min": min(gaps),
            "rollout_corr/ppl_ratio": seq_mean(math.exp(g) for g in gaps),
            "rollout_corr/chi2_token": sum(math.exp(-2.0 * x) - 1.0 for x in d_A) / n,
            "rollout_corr/chi2_seq": seq_mean(math.exp(2.0 * s) - 1.0 for _, _, s in seqs)}


def reference_rejection_ratio_mean(olds: Sequence[Tensor], behaviours: Sequence[Tensor],
                                   policy_masks: Sequence[Sequence[bool]], level: str) -> float:
    """``experience/rollout_rs_ratio_mean`` from its definition in float64: the plain mean over every policy token of
    the batch of the ratio it is judged by, exp(l) with l = old_t - behaviour_t (token), their sum over its sequence
    (sequence) or their mean (geometric), l clamped to +-20 as the metric's definition clamps it."""
    ratios: list[float] = []
    for old_R, behaviour_R, mask in zip(olds, behaviours, policy_masks):
        log_r = [o - b for o, b, m in zip(old_R.double().tolist(), behaviour_R.double().tolist(), mask) if m]
        if log_r and level != "token":
            total = sum(log_r) / (len(log_r) if level == "geometric" else 1)
            log_r = [total] * len(log_r)
        ratios += [math.exp(min(max(x, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)) for x in log_r]
    return sum(ratios) / len(ratios)


def _outside(raw: Tensor, correction: IsCorrection) -> Tensor:
    """Which raw weights lie outside [L, C] (above C without L)."""
    low = correction.low if correction.low is not None else 0.0
    return (raw > correction.cap) | (raw < low)


def _stats(values_A: Tensor, prefix: str, *, mean: bool = True, extrema: bool = False) -> dict[str, float]:
    """Plain mean (sum / count) and extrema over every valid token; absent when there is none."""
    out: dict[str, float] = {}
    if values_A.numel() == 0:
        return out
    v = values_A.to(torch.float64)
    if mean:
        out[f"{prefix}_mean" if extrema else prefix] = float(v.sum() / v.numel())
    if extrema:
        out[f"{prefix}_min"] = float(v.min())
        out[f"{prefix}_max"] = float(v.max())
    return out


def _cat(parts: Sequence[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in parts]) if parts else torch.zeros(0)


def reference_policy(model, batch: MiniBatch, settings: PolicyLossSettings, counts: Counts, *,
                     counted: Sequence[Sequence[bool]], behaviour: Optional[Sequence[Tensor]] = None,
                     correction: Optional[IsCorrection] = None,
                     policy_masks: Optional[Sequence[Sequence[bool]]] = None,
                     moe: Optional[MoeNormalizers] = None) -> tuple[float, dict, dict]:
    """Forward and backward of the policy loss one sequence at a time: the loss, the directly computed metrics, and
    the tolerance scale of each loss (the same aggregation of the per-token magnitudes, see :func:`_loss_scales`).

    With ``settings.use_is_weights`` the pg term is weighted by :func:`reference_is_weights` of each sequence's old
    and ``behaviour`` log-probs under ``correction`` (GMPO: by their geometric mean over the sequence) (never the targets' own ``is_weights``, which the product made).
    ``counted[i]``: sequence i's tokens that count (its per-token values are taken there only); ``policy_masks[i]``
    its policy's tokens (the importance weights' product runs over them; None: ``counted``).
    The gradient accumulates in ``model``. Sequences without a counted token add nothing and run no forward, except
    for an MoE policy (``moe``: the batch's load-balancing counts, `fsdptrain.check.moe_reference`), whose
    load-balancing loss counts every token of every sequence: each sequence adds ``coef`` x its share
    (`fsdptrain.check.per_sequence.sequence_moe_terms`) and the MoE metrics are computed directly (`DirectMoe`).
    """
    direct = DirectMoe(moe)
    if settings.use_is_weights and (behaviour is None or correction is None):
        raise ValueError("the reference's importance weights need the behaviour log-probs and the correction")
    mode = settings.agg_mode
    total = 0.0
    parts: dict[str, list[Tensor]] = {k: [] for k in ("pg", "ratio", "clip", "lower", "ppo_kl", "kl", "entropy")}
    other: list = []
    for i, (prompt_ids, response_ids, target) in enumerate(zip(batch.prompts, batch.responses, batch.targets)):
        at = torch.tensor([bool(k) for k in counted[i]], dtype=torch.bool)
        if not bool(at.any()) and moe is None:
            continue
        logp, entropy, routes = sequence_outputs(model, prompt_ids, response_ids, temperature=settings.temperature,
                                                 record=moe is not None)
        aux = direct.share(routes)
        if not bool(at.any()):  # MoE: its share alone, through the output too (FSDP unshards a layer there)
            (aux + 0.0 * logp.sum()).backward()
            total += float(aux.detach())
            continue
        at = at.to(logp.device)
        logp, entropy = logp[at], entropy[at]
        old = target.old_logprobs.to(logp)[at]
        adv = target.advantages.to(logp)[at]
        if settings.policy_loss == "vanilla":
            pg, ratio, clip, lower = _vanilla(logp, old, adv, settings)
        else:  # another loss: its own per-token function on this sequence alone, its metrics merged over sequences
            pg, pg_metrics = settings.pg_loss_fn(
                logp[None], old[None], adv[None], torch.ones_like(logp, dtype=torch.bool)[None],
                layout=SeqLayout((1, logp.numel()), None, logp.device), settings=settings)
            pg = pg[0]
            other.append(pg_metrics)
        if settings.use_is_weights:
            policy = policy_masks[i] if policy_masks is not None else counted[i]
            weights = reference_is_weights(target.old_logprobs, behaviour[i], correction, policy)[0]
            weights = weights[torch.tensor([bool(c) for p, c in zip(policy, counted[i]) if p], dtype=torch.bool)]
            if settings.policy_loss == "gmpo":  # GMPO takes the geometric mean of its sequence's weights
                weights = torch.prod(weights).pow(1.0 / weights.numel()).expand(weights.numel())
            pg = pg * weights.to(logp)
        loss = seq_share(pg, mode, counts)
        if settings.use_reference:
            kl = kl_direct(logp, target.ref_logprobs.to(logp)[at], settings.kl_estimator, settings.kl_clamp)
            loss = loss + settings.kl_coef * seq_share(kl, mode, counts)
            parts["kl"].append(kl.detach())
        if settings.entropy_coef != 0.0:
            loss = loss - settings.entropy_coef * seq_share(entropy, mode, counts)
        if aux is not None:
            loss = loss + aux.to(loss.dtype)
        loss.backward()
        total += float(loss.detach())
        parts["pg"].append(pg.detach())  # detached: an entropy outside the loss would keep its [R, V] graph alive
        parts["entropy"].append(entropy.detach())
        if not other:
            for key, value in (("ratio", ratio), ("clip", clip), ("lower", lower), ("ppo_kl", old - logp)):
                parts[key].append(value.detach())
    metrics, scales = _policy_metrics(parts, other, mode, counts)
    metrics.update(direct.metrics())
    scales["loss"] = scales["pg_loss"] + settings.entropy_coef * _magnitude(parts["entropy"], mode, counts)
    if settings.use_reference:
        metrics["kl_loss"] = float(sum(seq_share(k.detach(), mode, counts) for k in parts["kl"]))
        metrics.update(_stats(_cat(parts["kl"]), "kl"))
        scales["kl_loss"] = _magnitude(parts["kl"], mode, counts)
        scales["loss"] += settings.kl_coef * scales["kl_loss"]
    return total, metrics, scales


def _policy_metrics(parts: dict[str, list[Tensor]], other: list, mode: str, counts: Counts) -> tuple[dict, dict]:
    """The reference's directly computed pg metrics from the per-sequence ``parts`` (or a non-vanilla loss's own
    metrics, ``other``), and the pg loss's tolerance scale."""
    metrics = {
        "pg_loss": float(sum(seq_share(p.detach(), mode, counts) for p in parts["pg"])),
        **_stats(_cat(parts["entropy"]), "entropy"),
    }
    if other:
        metrics.update(finalize(merge_all(other)))
    else:
        metrics.update({
            **_stats(_cat(parts["clip"]), "pg_clipfrac"),
            **_stats(_cat(parts["lower"]), "pg_clipfrac_lower"),
            **_stats(_cat(parts["ppo_kl"]), "ppo_kl"),
            **_stats(_cat(parts["ratio"]), "probs_ratio", extrema=True),
        })
    return metrics, {"pg_loss": _magnitude(parts["pg"], mode, counts)}


def _vanilla(logp: Tensor, old: Tensor, adv: Tensor, settings: PolicyLossSettings):
    """PPO's clipped surrogate of one sequence, from its definition: (pg, ratio, clipped, dual-clipped)."""
    if settings.seq_level_ratio:  # GSPO: the value is the sequence ratio, the gradient s * grad logp
        log_ratio = (logp - old).detach().mean() + logp - logp.detach()
    else:
        log_ratio = logp - old
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(pg, dtype=torch.bool)
    if settings.clip_ratio_c is not None:
        dual = -adv * settings.clip_ratio_c
        lower = (adv < 0) & (pg > dual)
        pg = torch.where(adv < 0, torch.minimum(pg, dual), pg)
    return pg, ratio, clipped > unclipped, lower


def kl_direct(logp: Tensor, ref: Tensor, estimator: str, clamp: Optional[float]) -> Tensor:
    """The KL estimators from their definitions (docs/algorithms.md), d = logp - ref: k1 d; k2 = mse d^2/2; abs |d|;
    k3 exp(-d) + d - 1 (d clamped to +-20 inside, the value to +-clamp); k1+, k3+, abs+ the value of k1, k3, abs
    with k2's gradient."""
    d = logp - ref
    k2 = 0.5 * d * d
    k3 = torch.exp(-d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) + d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) - 1
    if clamp is not None:
        k3 = k3.clamp(-clamp, clamp)
    values = {"k1": d, "k2": k2, "mse": k2, "abs": d.abs(), "k3": k3,
              "k1+": d.detach() + k2 - k2.detach(), "k3+": k3.detach() + k2 - k2.detach(),
              "abs+": d.abs().detach() + k2 - k2.detach()}
    return values[estimator]


def _magnitude(per_seq_R: Sequence[Tensor], mode: str, counts: Counts) -> float:
    """The aggregation of |L|: the size of the terms a loss sums. A whitened advantage makes pg_loss cancel to about
    0, and its fp32 rounding is then relative to this, not to the tiny result."""
    return float(sum(seq_share(x.detach().abs(), mode, counts) for x in per_seq_R))


def explained_variance_direct(returns_A: Tensor, values_A: Tensor) -> Optional[float]:
    """1 - Var(R - v) / Var(R) from the whole vectors (two-pass variances); None when Var(R) is (almost) 0."""
    if returns_A.numel() == 0:
        return None
    var_r = returns_A.var(unbiased=False)
    if float(var_r) <= EV_DEGENERATE * float(returns_A.square().mean()):
        return None
    return float(1.0 - (returns_A - values_A).var(unbiased=False) / var_r)


def reference_critic(model, batch: MiniBatch, settings: ValueLossSettings, counts: Counts, *,
                     counted: Sequence[Sequence[bool]]) -> tuple[float, dict, dict]:
    """Forward and backward of the value loss one sequence at a time, at each sequence's ``counted`` tokens: the
    loss, the metrics, the loss scales."""
    total = 0.0
    parts: dict[str, list[Tensor]] = {k: [] for k in ("err", "clip", "values", "returns")}
    for prompt_ids, response_ids, target, mask in zip(batch.prompts, batch.responses, batch.targets, counted):
        at = torch.tensor([bool(k) for k in mask], dtype=torch.bool)
        if not bool(at.any()):
            continue
        values = reference_values(model, prompt_ids, response_ids)
        at = at.to(values.device)
        values = values[at]
        old, returns = target.old_values.to(values)[at], target.returns.to(values)[at]
        unclipped = (values - returns).square()
        if settings.cliprange_value is None:
            err, clip = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
        else:
            c = settings.cliprange_value
            v_clipped = torch.minimum(torch.maximum(values, old - c), old + c)  # v itself when |v - old| <= c
            clipped = (v_clipped - returns).square()
            err, clip = torch.maximum(unclipped, clipped), clipped > unclipped
        loss = seq_share(0.5 * err, settings.agg_mode, counts)
        loss.backward()
        total += float(loss.detach())
        for key, value in (("err", err), ("clip", clip), ("values", values), ("returns", returns)):
            parts[key].append(value.detach())
    values_A, returns_A = _cat(parts["values"]), _cat(parts["returns"])
    metrics = {
        "vf_loss": total,
        **_stats(_cat(parts["clip"]), "vf_clipfrac"),
        **_stats(values_A, "values", extrema=True),
        **_stats(returns_A, "returns_mean"),
    }
    ev = explained_variance_direct(returns_A, values_A)
    if ev is not None:
        metrics["vf_explained_var"] = ev
    return total, metrics, {"loss": total, "vf_loss": total}  # a sum of squares does not cancel


def reference_rollout_metrics(facts: Sequence[RolloutFacts]) -> dict[str, float]:
    """The step's rollout metrics straight from every rank's sequences (what ``Trainer.rollout_metrics`` logs)."""
    rewards = [f.reward for f in facts]
    lengths = [f.num_policy_tokens for f in facts]
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/max": max(rewards),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/truncated_frac": sum(f.truncated for f in facts) / len(facts),
        "batch/num_seqs": float(len(facts)),
        "batch/num_response_tokens": float(sum(f.num_response_tokens for f in facts)),
        "batch/num_prompt_tokens": float(sum(f.num_prompt_tokens for f in facts)),
    }
