"""Experience: from this rank's rollouts to per-sequence training targets.

Legend: `_R` one sequence's response-aligned values (element j belongs to response token j), `_BR` those padded.

Every model pass here is packed and runs the agreed number of forwards on every rank (a rank with fewer sequences runs
empty packs), exactly like training. Old log-probs come from the same packed forward and backend as training, so the
first mini-batch's ratio is 1 up to rounding (the on-policy guard); rollouts that carry behaviour log-probs use those
instead. Statistics that span ranks (advantage whitening) go through the all-reduce passed in by the loop.

Advantages come from the estimator registry (`fsdptrain/rl/adv_estimators.py`: a built-in or a user's function);
whitening, when the estimator asks for it, uses the global moments from one all-reduce. With
`algorithm.rollout_correction` the old log-probs stay the trainer's own and the behaviour log-probs (when a rollout
carries them) give the importance weights; without it, behaviour log-probs replace the old ones.

Departures from verl: the KL-in-reward penalty uses the k1 estimator per token; whitening uses an unbiased variance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.config import ConfigError
from fsdptrain.data.packing import pack_sequences, unpack_responses
from fsdptrain.data.rollout import Rollout
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import plan_agreed
from fsdptrain.model.forward import value_token_outputs
from fsdptrain.rl.adv_estimators import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageResult,
    AdvSettings,
    resolve_adv_estimator,
    whiten_stats,
    whitened,
)
from fsdptrain.rl.metrics import Metrics
from fsdptrain.rl.packed_loss import SeqTargets
from fsdptrain.rl.rollout_correction import rollout_correction_weights
from fsdptrain.train.step import policy_token_outputs


@torch.no_grad()
def packed_pass(model, rollouts: Sequence[Rollout], *, forward: Callable, token_budget: int,
                device: torch.device) -> list[Tensor]:
    """``forward(model, packed) -> [T]`` over this rank's sequences in agreed packs; per sequence its `_R` values.

    Collective: every rank runs the same number of forwards.
    """
    prompts = [r.prompt_ids for r in rollouts]
    responses = [r.response_ids for r in rollouts]
    plan = plan_agreed([len(p) + len(r) for p, r in zip(prompts, responses)], token_budget)
    out: list[Optional[Tensor]] = [None] * len(rollouts)
    for pack in plan.packs:
        packed = pack_sequences(prompts, responses, pack).to(device)
        for index, values_R in zip(pack, unpack_responses(forward(model, packed), packed)):
            out[index] = values_R.detach().float().cpu()
    assert all(v is not None for v in out)
    return out  # type: ignore[return-value]


def policy_logprobs(model, rollouts, *, temperature: float, chunk_size: int, token_budget: int,
                    device: torch.device) -> list[Tensor]:
    """Response log-probs under ``model`` from the packed training forward (fused chunked projection)."""

    def forward(m, packed):
        return policy_token_outputs(m, packed, temperature=temperature, chunk_size=chunk_size,
                                    compute_entropy=False)[0]

    return packed_pass(model, rollouts, forward=forward, token_budget=token_budget, device=device)


def reference_logprobs(reference, rollouts, **logprob_args) -> Optional[list[Tensor]]:
    """Response log-probs under the reference policy (a `fsdptrain.train.build.ReferencePolicy`: a frozen copy, or
    the policy with its adapters disabled), or None without one; arguments as `policy_logprobs`."""
    if reference is None:
        return None
    with reference.forward_context():
        return policy_logprobs(reference.model, rollouts, **logprob_args)


def critic_values(model, rollouts, *, token_budget: int, device: torch.device) -> list[Tensor]:
    """Values at the response-scoring positions under the value model."""
    return packed_pass(model, rollouts, forward=value_token_outputs, token_budget=token_budget, device=device)


def token_rewards(rollouts: Sequence[Rollout], *, kl_R: Optional[Sequence[Tensor]], kl_coef: float) -> list[Tensor]:
    """Per token: the outcome reward on the last response token, minus ``kl_coef * kl_t`` on every token if given."""
    out = []
    for i, rollout in enumerate(rollouts):
        rewards_R = torch.zeros(len(rollout.response_ids), dtype=torch.float32)
        rewards_R[-1] = rollout.reward
        if kl_R is not None and kl_coef != 0.0:
            rewards_R = rewards_R - kl_coef * kl_R[i]
        out.append(rewards_R)
    return out


def reward_to_go(rewards_R: Tensor) -> Tensor:
    """Undiscounted return from each token on: ``G_t = sum_{k >= t} r_k`` (the critic's target without GAE)."""
    return torch.flip(torch.cumsum(torch.flip(rewards_R, [0]), 0), [0])


def _pad(values: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    width = max((v.numel() for v in values), default=0)
    padded_BR = torch.zeros(len(values), width, dtype=torch.float32)
    mask_BR = torch.zeros(len(values), width, dtype=torch.bool)
    for i, v in enumerate(values):
        padded_BR[i, : v.numel()] = v
        mask_BR[i, : v.numel()] = True
    return padded_BR, mask_BR


def _unpad(padded_BR: Tensor, values: Sequence[Tensor]) -> list[Tensor]:
    return [padded_BR[i, : v.numel()].clone() for i, v in enumerate(values)]


@dataclass(frozen=True)
class ExperienceSettings:
    """What the experience needs from the config (built once per run by :func:`experience_settings`)."""

    adv_fn: Callable
    adv: AdvSettings
    kl_in_reward_coef: float
    temperature: float
    chunk_size: int
    token_budget: int
    rollout_correction: str = "none"
    rollout_correction_level: str = "token"
    rollout_correction_cap: float = 2.0
    rollout_correction_low: Optional[float] = None


def experience_settings(cfg) -> ExperienceSettings:
    """The settings of ``cfg``; resolves ``algorithm.adv_estimator`` (a built-in or a user's function)."""
    alg = cfg.algorithm
    return ExperienceSettings(
        adv_fn=resolve_adv_estimator(alg.adv_estimator),
        adv=AdvSettings(gamma=alg.gamma, lam=alg.lam, whiten_advantages=alg.whiten_advantages,
                        norm_adv_by_std=alg.norm_adv_by_std),
        kl_in_reward_coef=alg.kl_in_reward_coef, temperature=cfg.rollout.temperature,
        chunk_size=cfg.loss.logprob_chunk_size, token_budget=cfg.trainer.token_budget,
        rollout_correction=alg.rollout_correction, rollout_correction_level=alg.rollout_correction_level,
        rollout_correction_cap=alg.rollout_correction_cap, rollout_correction_low=alg.rollout_correction_low)


def _sum_over_ranks(stats: Tensor) -> Tensor:
    """The one all-reduce of the whitening moments (a module-level name, so a test can plant a local-only bug)."""
    return world.all_reduce_sum(stats)


def estimate_advantages(rewards_R: Sequence[Tensor], values_R: Optional[Sequence[Tensor]], rollouts, *,
                        adv_fn: Callable, settings: AdvSettings,
                        sum_across_ranks: Callable[[Tensor], Tensor] = None) -> tuple[list, Optional[list]]:
    """Per sequence: advantages (whitened with the global moments when the estimator asks) and returns (None when
    the estimator defines none). Collective: exactly one all-reduce, whatever the estimator (its `whiten` flag rides
    along, so a function that asks on some ranks only is an error, not a hang).

    A user's function that returns the wrong type or shape is a ConfigError (exit 2).
    """
    sum_across_ranks = sum_across_ranks or _sum_over_ranks
    rewards_BR, mask_BR = _pad(rewards_R)
    values_BR = _pad(values_R)[0] if values_R is not None else None
    scores_N = torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float32)
    groups_N = torch.tensor([int(r.group) for r in rollouts], dtype=torch.long)
    result = adv_fn(token_rewards_BT=rewards_BR, values_BT=values_BR, mask_BT=mask_BR, scores_N=scores_N,
                    group_ids_N=groups_N, settings=settings)
    _check_result(result, mask_BR)
    stats = torch.cat([whiten_stats(result, mask_BR), torch.tensor([float(result.whiten), 1.0], dtype=torch.float64)])
    summed = sum_across_ranks(stats)
    asking, ranks = float(summed[3]), float(summed[4])
    if asking not in (0.0, ranks):
        raise ConfigError(f"the advantage estimator asked for whitening on {asking:g} of {ranks:g} ranks: its "
                          "`whiten` flag must depend on the settings only")
    adv_BR = whitened(result, mask_BR, summed[:3]) if result.whiten else result.advantages_BT
    returns = _unpad(result.returns_BT.float(), rewards_R) if result.returns_BT is not None else None
    return _unpad(adv_BR.float(), rewards_R), returns


def _check_result(result, mask_BR: Tensor) -> None:
    if not isinstance(result, AdvantageResult):
        raise ConfigError(f"algorithm.adv_estimator returned a {type(result).__name__}; it must return "
                          "fsdptrain.rl.adv_estimators.AdvantageResult(advantages_BT, returns_BT or None, whiten)")
    for name in ("advantages_BT", "returns_BT"):
        value = getattr(result, name)
        if (value is not None or name == "advantages_BT") and (
                not isinstance(value, Tensor) or value.shape != mask_BR.shape):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ConfigError(f"algorithm.adv_estimator returned {name} of shape {shape}; it must be "
                              f"{tuple(mask_BR.shape)} (the rank's sequences x the longest response)")


def correction_weights(old_R: Sequence[Tensor], behaviour_R: Sequence[Tensor], *, mode: str, level: str,
                       cap: float, low: Optional[float] = None) -> tuple[list[Tensor], Metrics]:
    """Rollout-correction importance weights per sequence (`rollout_correction_weights`) and their metrics (this
    rank's; the caller reduces them with the step's)."""
    old_BR, mask_BR = _pad(old_R)
    behaviour_BR, _ = _pad(behaviour_R)
    weights_BR, metrics = rollout_correction_weights(old_BR, behaviour_BR, mask_BR, mode=mode, level=level, cap=cap,
                                                         low=low)
    return _unpad(weights_BR, old_R), metrics.prefixed("experience/")


def make_targets(models, rollouts: Sequence[Rollout], settings: ExperienceSettings, *, device: torch.device,
                 skip_old_passes: bool = False) -> tuple[list[SeqTargets], bool, Metrics]:
    """Old/ref log-probs, values, rewards, advantages, returns and importance weights for this rank's rollouts.

    Collective (packed passes, one all-reduce). Returns the targets, whether the step is on-policy (no rollout
    carries behaviour log-probs), and this rank's experience metrics (rollout correction; empty without it).
    ``skip_old_passes`` (strictly on-policy updates only, see fsdptrain/train/build.py `skips_old_passes`): the old
    log-probs, and the critic's old values when the estimator does not read them, are left None; the first update
    forward's detached outputs stand in for them, which is what the passes would have computed.
    """
    budget = settings.token_budget
    logprob_args = dict(temperature=settings.temperature, chunk_size=settings.chunk_size, token_budget=budget,
                        device=device)
    if skip_old_passes:
        return _on_policy_targets(models, rollouts, settings, logprob_args)
    old = policy_logprobs(models.policy, rollouts, **logprob_args)
    behaviour = [torch.tensor(r.behaviour_logprobs, dtype=torch.float32) if r.behaviour_logprobs is not None
                 else None for r in rollouts]
    on_policy = all(b is None for b in behaviour)
    weights, metrics = None, Metrics({})
    if settings.rollout_correction != "none":  # weights from behaviour to old; none carried: weight 1
        weights, metrics = correction_weights(old, [b if b is not None else o for b, o in zip(behaviour, old)],
                                              mode=settings.rollout_correction,
                                              level=settings.rollout_correction_level,
                                              cap=settings.rollout_correction_cap,
                                              low=settings.rollout_correction_low)
    else:  # without a correction the behaviour log-probs are the old policy's
        old = [b if b is not None else o for b, o in zip(behaviour, old)]
    ref = reference_logprobs(models.reference, rollouts, **logprob_args)
    kl_R = [o - r for o, r in zip(old, ref)] if ref is not None else None
    rewards = token_rewards(rollouts, kl_R=kl_R, kl_coef=settings.kl_in_reward_coef)
    values = critic_values(models.critic, rollouts, token_budget=budget, device=device) if models.critic is not None else None
    advantages, returns = estimate_advantages(rewards, values, rollouts, adv_fn=settings.adv_fn,
                                              settings=settings.adv)
    if values is not None and returns is None:
        returns = [reward_to_go(r) for r in rewards]
    targets = [SeqTargets(old_logprobs=old[i], advantages=advantages[i],
                          ref_logprobs=ref[i] if ref is not None else None,
                          old_values=values[i] if values is not None else None,
                          returns=returns[i] if values is not None else None,
                          is_weights=weights[i] if weights is not None else None)
               for i in range(len(rollouts))]
    return targets, on_policy, metrics


def _on_policy_targets(models, rollouts: Sequence[Rollout], settings: ExperienceSettings,
                       logprob_args: dict) -> tuple[list[SeqTargets], bool, Metrics]:
    """`make_targets` without the old log-prob pass (and without the critic's pass when the built-in estimator reads
    no values): no behaviour log-probs, no KL in the reward, no rollout correction (the caller guarantees it)."""
    ref = reference_logprobs(models.reference, rollouts, **logprob_args)
    rewards = token_rewards(rollouts, kl_R=None, kl_coef=0.0)
    needs_values = models.critic is not None and settings.adv_fn is ADV_ESTIMATOR_REGISTRY["gae"]
    values = (critic_values(models.critic, rollouts, token_budget=logprob_args["token_budget"],
                            device=logprob_args["device"]) if needs_values else None)
    advantages, returns = estimate_advantages(rewards, values, rollouts, adv_fn=settings.adv_fn, settings=settings.adv)
    if models.critic is not None and returns is None:
        returns = [reward_to_go(r) for r in rewards]
    targets = [SeqTargets(old_logprobs=None, advantages=advantages[i],
                          ref_logprobs=ref[i] if ref is not None else None,
                          old_values=values[i] if values is not None else None,
                          returns=returns[i] if models.critic is not None else None)
               for i in range(len(rollouts))]
    return targets, True, Metrics({})
