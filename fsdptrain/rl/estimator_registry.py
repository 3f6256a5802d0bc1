"""Advantage estimators behind one signature: gae, grpo, rloo, reinforce_plus_plus(_baseline), and user functions.

Every estimator is called the same way, by keyword, on this rank's sequences padded to `[B, T]`:

    fn(token_rewards_BT=, values_BT=, mask_BT=, scores_N=, group_ids_N=, settings=) -> AdvantageResult

- `token_rewards_BT`: per-token rewards (the outcome on the last response token, minus any KL-in-reward penalty);
- `values_BT`: the critic's values, or None without a critic; `mask_BT`: the response tokens;
- `scores_N`: each sequence's outcome score (what the group baselines compare); `group_ids_N`: its prompt group's
  *global* index (a group never spans ranks, so group statistics are local and the same for any world size);
- `settings`: `AdvSettings` from the config.

The result holds the *raw* advantages and a `whiten` flag. Whitening spans the global batch, so the caller does it
with one all-reduce: `whiten_stats(result, mask_BT)` gives the additive (sum, sum of squares, count), the caller sums
it over ranks, and `whitened(result, mask_BT, summed)` applies it. Nothing here reduces across ranks. `whiten` is a
function of the settings only, so every rank makes the same collective call.

Legend: `_BT` padded `[B, T]` per-token tensors, `_N` one value per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor

from fsdptrain.registry.names import ADV_ESTIMATOR_ARGS
from fsdptrain.registry.plugins import registered
from fsdptrain.registry.user_functions import resolve_function
from fsdptrain.rl.advantages import gae, grpo_advantages, mean_var, moment_stats, rloo_advantages, whiten


@dataclass(frozen=True)
class AdvSettings:
    """Config `algorithm.*`: `gamma` and `lam` (GAE; `gamma` also discounts REINFORCE++'s return),
    `whiten_advantages` (GAE only: the REINFORCE++ estimators always whiten, the group ones never do),
    `norm_adv_by_std` (GRPO: divide by the group's std)."""

    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    norm_adv_by_std: bool = True


@dataclass(frozen=True)
class AdvantageResult:
    """`advantages_BT`: raw advantages, 0 at masked positions; `returns_BT`: the critic's target, or None when the
    estimator defines none (the caller then uses the undiscounted reward-to-go); `whiten`: whether the caller must
    whiten `advantages_BT` with global moments (`whiten_stats` / `whitened`)."""

    advantages_BT: Tensor
    returns_BT: Optional[Tensor]
    whiten: bool


class AdvEstimatorFn(Protocol):
    def __call__(self, *, token_rewards_BT: Tensor, values_BT: Optional[Tensor], mask_BT: Tensor, scores_N: Tensor,
                 group_ids_N: Tensor, settings: AdvSettings) -> AdvantageResult: ...




def whiten_stats(result: AdvantageResult, mask_BT: Tensor) -> Tensor:
    """`[3]` float64 (sum, sum of squares, count) of the raw advantages over valid tokens: sum it over ranks."""
    return torch.stack(moment_stats(result.advantages_BT, mask_BT))


def whitened(result: AdvantageResult, mask_BT: Tensor, summed_stats: Tensor) -> Tensor:
    """(A - mean) / sqrt(var + 1e-8) at valid tokens with the global mean and unbiased variance from the summed
    `whiten_stats`; 0 elsewhere. Only for a result with `whiten` set."""
    assert result.whiten, "whitened() on a result that does not ask for whitening"
    total, total_sq, count = summed_stats
    mean, var = mean_var(total, total_sq, count)
    return whiten(result.advantages_BT, mask_BT, mean=mean, var=var)


def _per_token(adv_N: Tensor, mask_BT: Tensor) -> Tensor:
    return torch.where(mask_BT != 0, adv_N[:, None], torch.zeros((), dtype=adv_N.dtype, device=adv_N.device))


def gae_estimator(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    """GAE (Schulman et al., arXiv 1506.02438) over the valid tokens: `fsdptrain.rl.advantages.gae`; returns are
    A + V; whitened iff `settings.whiten_advantages`. Needs the critic's values."""
    if values_BT is None:
        raise ValueError("adv_estimator gae needs the critic's values: set algorithm.use_critic=true")
    adv_BT, ret_BT = gae(token_rewards_BT, values_BT, mask_BT, gamma=settings.gamma, lam=settings.lam)
    return AdvantageResult(adv_BT, ret_BT, settings.whiten_advantages)


def grpo_estimator(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    """GRPO (Shao et al., arXiv 2402.03300): (s_i - mean_g) / (std_g + 1e-6), or s_i - mean_g without
    `norm_adv_by_std` (Dr. GRPO), on every token of sequence i; not whitened; no returns."""
    adv_N = grpo_advantages(scores_N, group_ids_N, scale_by_std=settings.norm_adv_by_std)
    return AdvantageResult(_per_token(adv_N, mask_BT), None, False)


def rloo_estimator(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    """RLOO (Ahmadian et al., arXiv 2402.14740): s_i - mean of the other scores of its group, on every token of i;
    not whitened; no returns."""
    return AdvantageResult(_per_token(rloo_advantages(scores_N, group_ids_N), mask_BT), None, False)


def reinforce_plus_plus_estimator(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    """REINFORCE++ (Hu, arXiv 2501.03262; verl's "reinforce_plus_plus"): the discounted return-to-go of the token
    rewards over valid tokens, G_t = r_t + gamma G_next (= GAE with V = 0, lambda = 1), then whitened over the
    global batch (always). Returns: G itself (the critic's target if one is trained)."""
    # With V = 0 both outputs of gae are G (two tensors).
    adv_BT, returns_BT = gae(token_rewards_BT, torch.zeros_like(token_rewards_BT), mask_BT, gamma=settings.gamma,
                             lam=1.0)
    return AdvantageResult(adv_BT, returns_BT, True)


def reinforce_plus_plus_baseline_estimator(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    """REINFORCE++-baseline (verl's "reinforce_plus_plus_baseline"): s_i - mean_g on every token of i, then whitened
    over the global batch's valid tokens (token-weighted, as verl). Departures: a group of one gets 0 before
    whitening (verl passes its raw score), and s_i is the outcome score (verl sums the token rewards, which include
    any KL-in-reward penalty). No returns."""
    centred_N = grpo_advantages(scores_N, group_ids_N, scale_by_std=False)
    return AdvantageResult(_per_token(centred_N, mask_BT), None, True)


ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimatorFn] = {
    "gae": gae_estimator,
    "grpo": grpo_estimator,
    "rloo": rloo_estimator,
    "reinforce_plus_plus": reinforce_plus_plus_estimator,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_estimator,
}


def resolve_adv_estimator(name_or_spec: str, *, what: str = "algorithm.adv_estimator") -> AdvEstimatorFn:
    """A built-in by name (`ADV_ESTIMATORS`), or a user's `module:function` / `path.py:function` whose signature takes
    `ADV_ESTIMATOR_ARGS` by keyword, or a name registered with `fsdptrain.register_adv_estimator`. Raises ConfigError (one line) for an unknown name or a function that does not fit.
    """
    return resolve_function(name_or_spec, ADV_ESTIMATOR_REGISTRY, what=what, required=ADV_ESTIMATOR_ARGS,
                            plugged=registered("algorithm.adv_estimator"))
