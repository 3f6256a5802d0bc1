"""Policy loss: a policy-gradient term (`pg_losses`: PPO's clipped surrogate by default), KL penalty, entropy.

Tensors are per token in one of two layouts: padded `[B, T]` (a row is a sequence) or packed `[T]`/`[1, T]` with
`cu_seqlens` (a segment is a sequence). Every term is aggregated with `agg_loss`, so the same mode and global
normalizers apply to all of them.

Departures: the log-ratio is clamped to [-20, 20] before `exp` for both the token and the sequence ratio (verl
clamps the sequence one at 10 from above only); dual-clip is off unless `clip_ratio_c` is given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fsdptrain.registry.constants import KL_CLAMP, LOG_RATIO_CLAMP
from fsdptrain.registry.names import KL_ESTIMATORS
from fsdptrain.rl.aggregate import LossNormalizers, SeqLayout, agg_loss_with, check_mode, masked
from fsdptrain.metrics.typed import Loss, Mean, Metrics
from fsdptrain.rl.pg_terms import PgTermSettings, PolicyLossFn, vanilla_policy_loss, weigh_by_rollout_is


def _k1(d: Tensor, kl_clamp: float | None) -> Tensor:
    return d


def _k2(d: Tensor, kl_clamp: float | None) -> Tensor:
    return 0.5 * d.square()


def _abs(d: Tensor, kl_clamp: float | None) -> Tensor:
    return d.abs()


def _k3(d: Tensor, kl_clamp: float | None) -> Tensor:
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(-d) + d - 1.0
    return k3 if kl_clamp is None else k3.clamp(-kl_clamp, kl_clamp)


def _straight_through_k2(value_fn):
    def estimate(d: Tensor, kl_clamp: float | None) -> Tensor:
        k2 = _k2(d, kl_clamp)
        return value_fn(d, kl_clamp).detach() + (k2 - k2.detach())

    return estimate


# Keys are names.KL_ESTIMATORS (a test holds them equal).
_KL = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
    "mse": _k2,
    "k1+": _straight_through_k2(_k1),
    "k3+": _straight_through_k2(_k3),
    "abs+": _straight_through_k2(_abs),
}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, *, kl_clamp: float | None = KL_CLAMP) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens, d = logp - ref_logp:

        k1 = d;  k2 = mse = d^2 / 2;  abs = |d|;
        k3 = clamp(exp(-d) + d - 1, -kl_clamp, kl_clamp): unbiased, low variance, >= 0; d is clamped to +-20
             inside exp, and the value to kl_clamp (zero gradient outside; verl clamps its "low_var_kl" at 10);
             kl_clamp None: no clamp;
        k1+, k3+, abs+: straight-through, value k1 (k3, clamped as above; abs), gradient k2's (d * grad logp):
             sg[k] + k2 - sg[k2].
    k1 and k3 estimate the KL's value without bias but not its gradient; the gradient of k2 is the KL's gradient in
    expectation over samples of pi, hence the "+" forms (verl's estimators with a "+" suffix).
    """
    if estimator not in _KL:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    if kl_clamp is not None and not kl_clamp > 0:
        raise ValueError(f"kl_clamp must be > 0 or None (no clamp), got {kl_clamp}")
    return _KL[estimator](logprobs - ref_logprobs, kl_clamp)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) * z. Shape `[..., V] -> [...]`."""
    probs = torch.softmax(logits, dim=-1)
    # A -inf logit has probability 0 and contributes 0 (not 0 * -inf = NaN).
    weighted = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    norms: LossNormalizers,
    agg_mode: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    seq_level_ratio: bool = False,
    cu_seqlens: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: float | None = KL_CLAMP,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    pg_loss_fn: PolicyLossFn = vanilla_policy_loss,
    dro_beta: float | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """loss = pg_loss + kl_coef * kl_loss - entropy_coef * entropy_loss, each term `agg_loss(term, mask, agg_mode)`.

    The per-token pg term is `pg_loss_fn(...)` (`fsdptrain.rl.pg_terms`: vanilla PPO by default, with
    `clip_ratio_*` and `seq_level_ratio` (GSPO); CISPO, GMPO, DRO (`dro_beta`) or a user's function); see
    `vanilla_policy_loss` for the clipped surrogate. The KL term is `kl_penalty(logp, ref_logp, kl_estimator,
    kl_clamp=kl_clamp)`. `rollout_is_weights` (detached; `rollout_correction_weights`) multiply the per-token pg
    term before it is aggregated (not the KL or entropy terms); GMPO takes their geometric mean per sequence
    (`fsdptrain.rl.pg_terms.weigh_by_rollout_is`). Only `logprobs` (and `entropy`) carry gradients;
    masked positions of every input are ignored, NaN included. `entropy` is the per-token entropy of the current policy (see `entropy_from_logits`).

    Metrics (token-weighted MEANs are over valid tokens):
        pg_loss, kl_loss (LOSS): the agg value / dp_size, so summing over micro-batches and ranks gives the
            mini-batch's value; kl_loss is before kl_coef; present iff `ref_logprobs` is given.
        the pg term's own metrics; for every built-in: pg_clipfrac, pg_clipfrac_lower, ppo_kl (MEAN) and
            probs_ratio_mean (MEAN), probs_ratio_min (MIN), probs_ratio_max (MAX) (see `fsdptrain.rl.pg_terms`).
        kl (MEAN): the KL estimator per token (iff `ref_logprobs`); entropy (MEAN, iff `entropy`).
    Every name above is returned for every batch, empty or not, so rank schemas agree.
    """
    check_mode(agg_mode)
    settings = PgTermSettings(clip_ratio_low, clip_ratio_high, clip_ratio_c, seq_level_ratio, dro_beta)
    if ref_logprobs is None and kl_coef != 0.0:
        raise ValueError("kl_coef is set but ref_logprobs is None: pass the reference log-probs or set kl_coef to 0")
    if entropy is None and entropy_coef != 0.0:
        raise ValueError("entropy_coef is set but entropy is None: pass the per-token entropy or set entropy_coef to 0")

    layout = SeqLayout(logprobs.shape, cu_seqlens, logprobs.device)
    valid = layout.valid(mask)
    logp = masked(logprobs, valid)
    old_logp = masked(old_logprobs, valid).detach()
    adv = masked(advantages, valid).detach()

    pg, pg_metrics = pg_loss_fn(logp, old_logp, adv, valid, layout=layout, settings=settings)
    if pg.shape != logp.shape:
        raise ValueError(f"the policy-loss function returned shape {tuple(pg.shape)}; it must return the per-token "
                         f"loss in the shape of logprobs, {tuple(logp.shape)} (policy_loss aggregates it)")
    reserved = {"pg_loss", "kl_loss", "kl", "entropy"} & set(pg_metrics)
    if reserved:
        raise ValueError(f"the policy-loss function returned metric {sorted(reserved)[0]!r}, a name policy_loss sets")
    if rollout_is_weights is not None:
        pg = weigh_by_rollout_is(pg, masked(rollout_is_weights, valid).detach(), valid, layout=layout,
                                 pg_loss_fn=pg_loss_fn)
    pg_loss = agg_loss_with(pg, valid, agg_mode, norms, cu_seqlens=cu_seqlens)
    loss = pg_loss
    metrics = {"pg_loss": Loss(pg_loss / norms.dp_size), **pg_metrics}
    if ref_logprobs is not None:
        kl = kl_penalty(logp, masked(ref_logprobs, valid).detach(), kl_estimator, kl_clamp=kl_clamp)
        kl_loss = agg_loss_with(kl, valid, agg_mode, norms, cu_seqlens=cu_seqlens)
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = Loss(kl_loss / norms.dp_size)
        metrics["kl"] = Mean.of(kl, valid)
    if entropy is not None:
        ent = masked(entropy, valid)
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * agg_loss_with(ent, valid, agg_mode, norms, cu_seqlens=cu_seqlens)
        metrics["entropy"] = Mean.of(ent, valid)
    return loss, Metrics(metrics)
