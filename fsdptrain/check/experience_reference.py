"""check-metrics, part 5: the experience reference. Rewards, advantages and returns of every sequence recomputed
straight from their definitions, in float64 Python loops, without `fsdptrain.rl.advantages` or
`fsdptrain.rl.estimator_registry`, over the whole gathered batch (so whitening uses the global moments by construction).

Definitions (docs/algorithms.md), per sequence i with response tokens t = 0..T-1, outcome score s_i, prompt group g:
    r_t = [t = T-1] s_i - kl_in_reward_coef * (old_logp_t - ref_logp_t)
    gae:  delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}  (V_T = A_T = 0);  R_t = A_t + V_t
    reinforce_plus_plus:  A_t = R_t = G_t = r_t + gamma G_{t+1}
    grpo: (s_i - mean_g) / (std_g + 1e-6) (unbiased std), s_i - mean_g without norm_adv_by_std; rloo:
    s_i - (sum_g - s_i) / (n_g - 1); reinforce_plus_plus_baseline: s_i - mean_g; a group of one: 0.
    whitening (gae with whiten_advantages, both REINFORCE++): (A - mean) / sqrt(var + 1e-8), mean and unbiased var
    over every response token of the batch. Without the estimator's own returns, the critic's target is the
    undiscounted reward-to-go sum_{k >= t} r_k.
With a response mask (multi-turn), t runs over the policy's tokens only, as if the tools' tokens were cut out of the
response: the outcome sits on the last policy token, the KL penalty and every advantage and return on policy tokens,
GAE's next value is the next policy token's, whitening pools policy tokens; a tool's token gets 0 everywhere.
A user's estimator has no definition here: the oracle returns None for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from fsdptrain.check.compare import worst_of

WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclass(frozen=True)
class SeqInputs:
    """One sequence's inputs to its experience: score, group, and per response token old/ref log-probs, values."""

    score: float
    group: int
    old: list[float]
    ref: Optional[list[float]]
    values: Optional[list[float]]
    policy: Optional[list[bool]] = None
    """Per response token, whether the policy sampled it (None: every token)."""

    def kept(self, per_token: list) -> list:
        """``per_token`` at the policy's tokens only (the tools' cut out)."""
        return list(per_token) if self.policy is None else [x for x, p in zip(per_token, self.policy) if p]

    def expanded(self, at_policy: list[float]) -> list[float]:
        """The inverse of :meth:`kept`: the policy tokens' values back in place, 0 at a tool's token."""
        if self.policy is None:
            return list(at_policy)
        values = iter(at_policy)
        return [next(values) if p else 0.0 for p in self.policy]


@dataclass(frozen=True)
class OracleSettings:
    estimator: str
    gamma: float
    lam: float
    whiten_advantages: bool
    norm_adv_by_std: bool
    kl_in_reward_coef: float


def token_rewards(seq: SeqInputs, kl_coef: float) -> list[float]:
    """The rewards at the policy's tokens (the tools' cut out)."""
    n = len(seq.kept(seq.old))
    out = [0.0] * n
    if n:
        out[-1] = seq.score
    if seq.ref is not None and kl_coef != 0.0:
        out = [r - kl_coef * (o - f) for r, o, f in zip(out, seq.kept(seq.old), seq.kept(seq.ref))]
    return out


def _discounted(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    adv, next_adv, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[t]
        adv[t] = next_adv
    return adv


def _group_advantage(seqs: Sequence[SeqInputs], i: int, s: OracleSettings) -> float:
    scores = [q.score for q in seqs if q.group == seqs[i].group and q.old]
    n, mine = len(scores), seqs[i].score
    if n < 2:
        return 0.0
    mean = sum(scores) / n
    if s.estimator == "rloo":
        return mine - (sum(scores) - mine) / (n - 1)
    if s.estimator == "grpo" and s.norm_adv_by_std:
        std = math.sqrt(sum((x - mean) ** 2 for x in scores) / (n - 1))
        return (mine - mean) / (std + 1e-6)
    return mine - mean


def oracle_experience(seqs: Sequence[SeqInputs], s: OracleSettings,
                      ) -> Optional[list[tuple[list[float], Optional[list[float]]]]]:
    """Per sequence (advantages, returns or None without a critic); None for a user's estimator."""
    rewards = [token_rewards(q, s.kl_in_reward_coef) for q in seqs]
    advantages: list[list[float]] = []
    returns: list[Optional[list[float]]] = []
    for i, q in enumerate(seqs):  # over the policy's tokens (n of them); expanded to every response token below
        n = len(rewards[i])
        if s.estimator == "gae":
            values = q.kept(q.values)
            adv = _discounted(rewards[i], values, s.gamma, s.lam)
            ret = [a + v for a, v in zip(adv, values)]
        elif s.estimator == "reinforce_plus_plus":
            adv = _discounted(rewards[i], [0.0] * n, s.gamma, 1.0)
            ret = list(adv)
        elif s.estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            adv, ret = [_group_advantage(seqs, i, s)] * n, None
        else:
            return None
        if ret is None and q.values is not None:
            ret = [sum(rewards[i][t:]) for t in range(n)]
        advantages.append(adv)
        returns.append(ret if q.values is not None else None)
    if s.estimator in WHITENED or (s.estimator == "gae" and s.whiten_advantages):
        flat = [a for adv in advantages for a in adv]
        mean = sum(flat) / len(flat)
        var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
        advantages = [[(a - mean) / math.sqrt(var + 1e-8) for a in adv] for adv in advantages]
    return [(q.expanded(adv), None if ret is None else q.expanded(ret))
            for q, adv, ret in zip(seqs, advantages, returns)]


def max_difference(got: Sequence[Sequence[float]], want: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(largest |got - want| over every token, largest |want|): a length mismatch is an infinite difference."""
    worst, scale = 0.0, 0.0
    for g, w in zip(got, want, strict=True):
        if len(g) != len(w):
            return math.inf, scale
        for a, b in zip(g, w):
            worst, scale = worst_of(worst, abs(a - b)), max(scale, abs(b))
    return worst, scale
