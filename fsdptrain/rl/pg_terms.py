"""Policy-gradient terms: vanilla PPO (asymmetric clip, dual-clip, GSPO), CISPO, GMPO, DRO, and user functions.

Every term has one signature, `PolicyLossFn`:

    fn(logprobs, old_logprobs, advantages, valid, *, layout, settings) -> (pg_per_token, Metrics)

- `logprobs` (carries the gradient), `old_logprobs`, `advantages` (detached): per token, in the padded `[B, T]` or
  the packed `[T]`/`[1, T]` layout, already 0 wherever `valid` is false (NaN never reaches a term);
- `valid`: bool, the tokens that count; `layout`: the `SeqLayout` (`seq_sum`, `broadcast`) for sequence terms;
- `settings`: `PolicyLossSettings`, the policy loss's one settings object (a term reads its clip ratios,
  `seq_level_ratio` and `dro_beta`).

It returns the per-token loss (same shape; its values at invalid positions are ignored) and its metrics. It never
aggregates: `policy_loss` aggregates the term with `agg_loss` under the configured mode and the global normalizers,
and logs it as `pg_loss` (LOSS), the same for every loss, a user's included, so none can get the dp factor or a
count wrong. A sequence-level term (GMPO) puts the sequence's loss on each of its tokens; under
`seq-mean-token-mean` the aggregate is then the mean over sequences of those losses, the paper's objective.
A function must return the same metric names for every batch, empty or not, so ranks agree on the schema.

Metrics of every built-in (token-weighted MEANs over valid tokens): pg_clipfrac (share of tokens where a clip
bound took effect), pg_clipfrac_lower (share of tokens where dual-clip bound; 0 outside vanilla), ppo_kl
(old_logp - logp), probs_ratio_mean (MEAN), probs_ratio_min (MIN), probs_ratio_max (MAX) of the ratio the loss uses.

Legend: `_N` one value per sequence; unsuffixed tensors are per token in the layout of `logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from torch import Tensor

from fsdptrain.registry.constants import KL_CLAMP, LOG_RATIO_CLAMP
from fsdptrain.registry.names import POLICY_LOSS_ARGS
from fsdptrain.registry.plugins import registered
from fsdptrain.registry.user_functions import resolve_function
from fsdptrain.rl.aggregate import SeqLayout
from fsdptrain.metrics.typed import Max, Mean, Metrics, Min


class PolicyLossFn(Protocol):
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, valid: Tensor, *,
                 layout: SeqLayout, settings: PolicyLossSettings) -> tuple[Tensor, Metrics]: ...




def _metrics(ratio: Tensor, clipped: Tensor, lower: Tensor, log_ratio: Tensor, valid: Tensor) -> Metrics:
    return Metrics({
        "pg_clipfrac": Mean.of(clipped.to(ratio.dtype), valid),
        "pg_clipfrac_lower": Mean.of(lower.to(ratio.dtype), valid),
        "ppo_kl": Mean.of(-log_ratio, valid),
        "probs_ratio_mean": Mean.of(ratio, valid),
        "probs_ratio_min": Min.of(ratio, valid),
        "probs_ratio_max": Max.of(ratio, valid),
    })


def _no_seq_ratio(settings: PolicyLossSettings, name: str) -> None:
    # clip_ratio_c is ignored outside vanilla (the config default sets it); GSPO's ratio is a deliberate choice.
    if settings.seq_level_ratio:
        raise ValueError(f"policy loss {name!r} has no sequence-ratio (GSPO) form: set seq_level_ratio=false "
                         "or choose policy_loss=vanilla")


def vanilla_policy_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    """PPO's clipped surrogate with asymmetric clip and optional dual-clip; GSPO's ratio with `seq_level_ratio`.

    Per token, with ratio r and advantage A:
        pg = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        and for A < 0 with dual-clip: pg = min(pg, -A clip_ratio_c)
    r = exp(logp - old_logp) (log-ratio clamped to +-20); with `seq_level_ratio` (GSPO) r is, for every token of
    sequence i, s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], s_i = exp(mean over i's valid tokens of (logp - old_logp)),
    whose value is s_i and whose gradient is s_i * grad logp_t (GSPO's objective under seq-mean-token-mean).
    pg_clipfrac: -A clip(r) > -A r; pg_clipfrac_lower: A < 0 and the dual-clip bound.
    """
    log_ratio = logprobs - old_logprobs
    if settings.seq_level_ratio:
        seq_len_N = layout.seq_sum(valid.to(torch.int64)).clamp(min=1)
        seq_log_ratio_N = layout.seq_sum(log_ratio.detach()) / seq_len_N
        log_ratio = layout.broadcast(seq_log_ratio_N) + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    clipfrac = clipped > unclipped
    if settings.clip_ratio_c is not None:
        dual = -advantages * settings.clip_ratio_c
        lower = (advantages < 0) & (pg > dual)
        pg = torch.where(advantages < 0, torch.minimum(pg, dual), pg)
    else:
        lower = torch.zeros_like(valid)
    return pg, _metrics(ratio, clipfrac, lower, logprobs - old_logprobs, valid)


def cispo_policy_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    """CISPO (MiniMax-M1, arXiv 2506.13585): the clipped importance weight, detached, times A log pi.

        pg = -sg[clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A * logp,   r = exp(logp - old_logp)
    gradient -clip(r) A grad logp: a token whose ratio left the range still gets a (bounded) gradient, where PPO's
    clip would drop it. The value is not a surrogate of the return (it carries logp), only its gradient matters.
    pg_clipfrac: r outside [1 - low, 1 + high]. The paper sets no lower bound in practice (a large clip_ratio_low).
    """
    _no_seq_ratio(settings, "cispo")
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    pg = -weight * advantages * logprobs
    return pg, _metrics(ratio, weight != ratio, torch.zeros_like(valid), log_ratio, valid)


def gmpo_policy_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673): the geometric mean of token ratios per sequence.

    Per token, d_t = logp_t - old_logp_t is clipped in log space, pessimistically for the sign of A_t:
        d'_t = sgn(A_t) * min(sgn(A_t) d_t, sgn(A_t) clip(d_t, -clip_ratio_low, clip_ratio_high))
    (A > 0: capped above at clip_ratio_high; A < 0: floored at -clip_ratio_low; A = 0: d_t itself, where verl's
    sgn(0) = 0 gives 0; advantages are meant to be constant over a sequence). Per sequence i with c_i valid
    tokens: R_i = exp(sum_t d'_t / c_i) (the geometric mean of the clipped ratios), A_i = mean_t A_t, and
        loss_i = -A_i R_i,   on every token of i.
    Under seq-mean-token-mean the mini-batch loss is mean_i loss_i, the paper's objective (verl's "geo_mean"; the
    paper's recommended range is (e^-0.4, e^0.4), i.e. clip_ratio_low = clip_ratio_high = 0.4). pg_clipfrac: tokens
    with d'_t != d_t; the probs_ratio metrics describe R_i per token.
    """
    _no_seq_ratio(settings, "gmpo")
    log_ratio = logprobs - old_logprobs
    bounded = log_ratio.clamp(-settings.clip_ratio_low, settings.clip_ratio_high)
    clipped_log_ratio = torch.where(advantages > 0, torch.minimum(log_ratio, bounded),
                                    torch.where(advantages < 0, torch.maximum(log_ratio, bounded), log_ratio))
    seq_len_N = layout.seq_sum(valid.to(torch.int64)).clamp(min=1)
    seq_ratio_N = torch.exp((layout.seq_sum(clipped_log_ratio) / seq_len_N).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    seq_adv_N = layout.seq_sum(advantages) / seq_len_N
    pg = layout.broadcast(-seq_adv_N * seq_ratio_N)
    ratio = layout.broadcast(seq_ratio_N.detach())
    return pg, _metrics(ratio, clipped_log_ratio != log_ratio, torch.zeros_like(valid), log_ratio, valid)


def dro_policy_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    """DRO, the regularised (quadratic-penalty) off-policy objective, per token:

        pg = -(A logp - dro_beta / 2 * (logp - old_logp)^2),   gradient (-A + dro_beta (logp - old_logp)) grad logp
    Source: "Offline Regularised Reinforcement Learning for LLM Alignment" (Richemond et al., arXiv 2405.19107)
    and Kimi k1.5 (arXiv 2501.12599), as the per-token loss of Thinking Machines' Tinker `dro` loss; old_logp plays
    the sampling distribution q. The penalty keeps the policy near the one that sampled. Departure: Tinker sums
    tokens; here the term is aggregated by `loss.agg_mode`; dro_beta has no default (verl refuses DRO without
    one). No clipping (pg_clipfrac 0); ratio = exp(logp - old_logp).
    """
    _no_seq_ratio(settings, "dro")
    if settings.dro_beta is None:
        raise ValueError("the dro loss needs dro_beta (its penalty weight, > 0); it has no default")
    log_ratio = logprobs - old_logprobs
    pg = -(advantages * logprobs - 0.5 * settings.dro_beta * log_ratio.square())
    ratio = torch.exp(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    none = torch.zeros_like(valid)
    return pg, _metrics(ratio, none, none, log_ratio, valid)


def sequence_geometric_mean(weights: Tensor, valid: Tensor, *, layout: SeqLayout) -> Tensor:
    """Per sequence i, on each of its tokens: (prod_t w_t)^(1/c_i) = exp(mean_t log w_t) over its c_i valid tokens.

    A zero weight (a token `mis` masked) makes its sequence's mean 0; a sequence without valid tokens gets 1 (its
    tokens count nowhere). Detached weights in, detached out.
    """
    log_w = torch.where(valid, torch.log(weights), torch.zeros((), dtype=weights.dtype, device=weights.device))
    seq_len_N = layout.seq_sum(valid.to(torch.int64)).clamp(min=1)
    return layout.broadcast(torch.exp(layout.seq_sum(log_w) / seq_len_N))


def weigh_by_rollout_is(pg: Tensor, weights: Tensor, valid: Tensor, *, layout: SeqLayout,
                        pg_loss_fn: PolicyLossFn) -> Tensor:
    """The per-token pg term times the rollout-correction weights w_t (detached).

    Every term takes w_t on its own token, except GMPO (`GEOMETRIC_IS_TERMS`), whose sequence loss is a geometric
    mean of ratios: it takes the geometric mean of its sequence's weights, `sequence_geometric_mean`, so the weighted
    loss is -A_i * geomean_t(r_t w_t) (verl's "geo_mean" likewise). Example: w = [0.5, 2], r = 1, A = 1: -1.0 (the
    arithmetic mean of the per-token weights would give -1.25).
    """
    if pg_loss_fn in GEOMETRIC_IS_TERMS:
        return pg * sequence_geometric_mean(weights, valid, layout=layout)
    return pg * weights


GEOMETRIC_IS_TERMS = frozenset({gmpo_policy_loss})
"""The pg terms that take a sequence's geometric mean of the rollout-correction weights (`weigh_by_rollout_is`)."""


POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {
    "vanilla": vanilla_policy_loss,
    "cispo": cispo_policy_loss,
    "gmpo": gmpo_policy_loss,
    "dro": dro_policy_loss,
}


@dataclass(frozen=True)
class PolicyLossSettings:
    """The policy loss's settings, built once from the config (`fsdptrain.train.setup.policy_settings`) and passed
    down whole: to the packed row's log-probs (`temperature`, `chunk_size`), to `fsdptrain.rl.policy_loss.policy_loss`
    (the aggregation, KL and entropy terms) and to the pg term (`pg_loss_fn`: a built-in or a user's function).

    `clip_ratio_low`/`clip_ratio_high`: the clip range [1 - low, 1 + high] of the ratio (vanilla, CISPO), or of the
    log-ratio [-low, high] (GMPO); `clip_ratio_c`: dual-clip bound (> 1; None off; vanilla only);
    `seq_level_ratio`: GSPO's sequence ratio (vanilla only); `dro_beta`: DRO's quadratic penalty weight (> 0;
    required by DRO, which has no default, as in verl; None for every other term).
    """

    agg_mode: str
    """`fsdptrain.rl.aggregate.agg_loss`'s mode, for every term."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    seq_level_ratio: bool = False
    kl_coef: float = 0.0
    """The KL term's weight (with `use_reference`)."""
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    """The sampling temperature the log-probs are taken at."""
    chunk_size: int = 256
    """Rows of the output head per chunk of the fused log-probs (`loss.logprob_chunk_size`)."""
    use_reference: bool = False
    """Compute the KL to the reference policy (kl_loss and kl metrics; `policy_loss` then needs `ref_logprobs`):
    fixed per run, so every rank's metric names agree, empty packs included."""
    kl_clamp: Optional[float] = KL_CLAMP
    """Bound on the k3/k3+ value (None: no clamp)."""
    pg_loss_fn: Callable = vanilla_policy_loss
    """The policy-gradient term (a built-in of this module or a user's function)."""
    policy_loss: str = "vanilla"
    """The config name of `pg_loss_fn` (check-metrics' reference writes vanilla PPO out from its definition)."""
    dro_beta: Optional[float] = None
    use_is_weights: bool = False
    """Multiply the pg term by the rollout-correction weights (`policy_loss` then needs `rollout_is_weights`)."""
    generation_gap: bool = False
    """Log ``rollout/logprob_diff/*`` from this forward (`fsdptrain.rl.fused_loss.generation_gap_metrics`): on when
    the old log-prob pass is skipped, whose stand-in this forward is; fixed per run, so every rank's metric names
    agree, empty packs included. Never read by the loss."""
    routing_replay: bool = False
    """A mixture-of-experts policy: its forward replays the pack's routes recorded at generation
    (``model.moe.routing_replay``, fsdptrain/train/pack_losses.py `pack_routing`). Never read by the loss."""

    def __post_init__(self):
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(f"clip ratios must be >= 0, got low={self.clip_ratio_low}, high={self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual-clip) must be > 1, got {self.clip_ratio_c}; use None to turn it off")
        if self.dro_beta is not None and not self.dro_beta > 0:
            raise ValueError(f"dro_beta must be > 0, got {self.dro_beta}")


def resolve_policy_loss(name_or_spec: str, *, what: str = "algorithm.policy_loss") -> PolicyLossFn:
    """A built-in by name (`POLICY_LOSSES`), or a user's `module:function` / `path.py:function` whose signature takes
    `POLICY_LOSS_ARGS` by keyword, or a name registered with `fsdptrain.register_policy_loss`. Raises ConfigError (one line) for an unknown name or a function that does not fit.
    """
    return resolve_function(name_or_spec, POLICY_LOSS_REGISTRY, what=what, required=POLICY_LOSS_ARGS,
                            plugged=registered("algorithm.policy_loss"))

