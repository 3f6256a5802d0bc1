"""Experience: from this rank's rollouts to per-sequence training targets.

Legend: `_R` one sequence's response-aligned values (element j belongs to response token j), `_BR` those padded.

Every model pass here is packed and runs the agreed number of forwards on every rank (a rank with fewer sequences runs
empty packs), exactly like training. Old log-probs come from the same packed forward and backend as training, so the
first mini-batch's ratio is 1 up to rounding (the on-policy guard); rollouts that carry behaviour log-probs use those
instead. Statistics that span ranks (advantage whitening) go through the all-reduce passed in by the loop.

Advantages come from the estimator registry (`fsdptrain/rl/estimator_registry.py`: a built-in or a user's function);
whitening, when the estimator asks for it, uses the global moments from one all-reduce. With
`algorithm.rollout_correction` the old log-probs stay the trainer's own and the behaviour log-probs (when a rollout
carries them) give the importance weights; without it, behaviour log-probs replace the old ones. Either way, the
rollouts that carry behaviour log-probs are compared with the trainer's own old log-probs once per step
(`rollout_corr/*`, :func:`off_policy_metrics`).

The per-token mask (docs/packing.md): a rollout's `response_mask` (None: every response token is the policy's)
decides which tokens get a reward, an advantage, a return, an importance weight and a KL penalty; the outcome reward
sits on the last *policy* token; GAE runs over the policy's tokens (`fsdptrain.rl.advantages.gae`); every target is 0
at a tool's token. With `algorithm.rollout_rejection`, tokens (or whole sequences) whose old/behaviour ratio falls
outside [low, high], and with `algorithm.rollout_rejection_divergence` those whose k2/k3 divergence exceeds its max,
then leave the mask (`fsdptrain.rl.rollout_correction.rollout_rejection`): the targets' `response_mask` is the
rollout's minus the rejected tokens, and the train step counts its normalisers from it.

Departures from verl: the KL-in-reward penalty uses the k1 estimator per token; whitening uses an unbiased variance;
rejection comes after the advantages (they are estimated over the rollout's policy tokens, rejected ones included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.config import ConfigError
from fsdptrain.data.packing import pack_sequences, unpack_responses
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.data.shared_prompts import pack_shared_prompts
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import plan_agreed, plan_agreed_shared
from fsdptrain.model.forward import value_token_outputs
from fsdptrain.rl.estimator_registry import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageResult,
    AdvSettings,
    resolve_adv_estimator,
    whiten_stats,
    whitened,
)
from fsdptrain.rl.distill import DistillSettings, distill_advantages, distill_metrics
from fsdptrain.metrics.typed import Max, Mean, Metrics, merge_all
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.rl.rollout_correction import (
    RejectionSettings,
    off_policy_diagnostics,
    rollout_correction_weights,
    rollout_rejection,
)
from fsdptrain.train.pack_losses import policy_token_outputs, route_mismatch_metrics, routed_token_outputs


@torch.no_grad()
def packed_pass(model, rollouts: Sequence[Rollout], *, forward: Callable, token_budget: int,
                device: torch.device, share_prompts: bool = False, routes: bool = False) -> list[Tensor]:
    """``forward(model, packed) -> [T]`` over this rank's sequences in agreed packs; per sequence its `_R` values.

    Collective: every rank runs the same number of forwards. ``share_prompts``: each pack's forward holds each of its
    prompts once (`fsdptrain.data.shared_prompts`). ``routes``: the packs carry the rollouts' recorded routes
    (`PackedBatch.routes`).
    """
    prompts = [r.prompt_ids for r in rollouts]
    responses = [r.response_ids for r in rollouts]
    if share_prompts:
        plan = plan_agreed_shared(prompts, responses, token_budget)
    else:
        plan = plan_agreed([len(p) + len(r) for p, r in zip(prompts, responses)], token_budget)
    pack_fn = pack_shared_prompts if share_prompts else pack_sequences
    out: list[Optional[Tensor]] = [None] * len(rollouts)
    for pack in plan.packs:
        packed = pack_fn(prompts, responses, pack, routes=[r.routes for r in rollouts] if routes else None).to(device)
        for index, values_R in zip(pack, unpack_responses(forward(model, packed), packed)):
            out[index] = values_R.detach().float().cpu()
    assert all(v is not None for v in out)
    return out  # type: ignore[return-value]


def policy_logprobs(model, rollouts, *, temperature: float, chunk_size: int, token_budget: int,
                    device: torch.device, share_prompts: bool = False) -> list[Tensor]:
    """Response log-probs under ``model`` from the packed training forward (fused chunked projection)."""

    def forward(m, packed):
        return policy_token_outputs(m, packed, temperature=temperature, chunk_size=chunk_size,
                                    compute_entropy=False)[0]

    return packed_pass(model, rollouts, forward=forward, token_budget=token_budget, device=device,
                       share_prompts=share_prompts)


def routed_policy_logprobs(model, rollouts, *, replay: bool, temperature: float, chunk_size: int, token_budget: int,
                           device: torch.device, share_prompts: bool = False) -> tuple[list[Tensor], Metrics]:
    """`policy_logprobs` of the old log-prob pass, and for a mixture-of-experts policy this rank's
    ``moe/topk_differ/*`` (`fsdptrain.train.pack_losses.route_mismatch_metrics`: the routers' own top-k against the
    routes recorded at generation); with ``replay`` each forward replays those routes (docs/moe.md)."""
    collected: list[Metrics] = []

    def forward(m, packed):
        logprobs_T, _, routes = routed_token_outputs(m, packed, temperature=temperature, chunk_size=chunk_size,
                                                     compute_entropy=False, record=True, replay=replay)
        collected.append(route_mismatch_metrics(routes, packed))
        return logprobs_T

    old = packed_pass(model, rollouts, forward=forward, token_budget=token_budget, device=device,
                      share_prompts=share_prompts, routes=True)
    return old, merge_all(collected)


def reference_logprobs(reference, rollouts, **logprob_args) -> Optional[list[Tensor]]:
    """Response log-probs under the reference policy (a `fsdptrain.train.setup.ReferencePolicy`: a frozen copy, or
    the policy with its adapters disabled), or None without one; arguments as `policy_logprobs`."""
    if reference is None:
        return None
    with reference.forward_context():
        return policy_logprobs(reference.model, rollouts, **logprob_args)


def teacher_logprobs(teacher, rollouts, **logprob_args) -> Optional[list[Tensor]]:
    """Response log-probs under the distillation teacher (``algorithm.distill.teacher``: a frozen sharded model, at
    the rollout temperature like the student's), or None without one; arguments as `policy_logprobs`."""
    if teacher is None:
        return None
    return policy_logprobs(teacher, rollouts, **logprob_args)


def distilled(advantages: Sequence[Tensor], student_R: Sequence[Tensor], teacher_R: Sequence[Tensor],
              masks: Sequence[Optional[Tensor]], settings: DistillSettings) -> tuple[list[Tensor], Metrics]:
    """Per sequence, the distillation advantage (`fsdptrain.rl.distill.distill_advantages`: the task's, when added,
    minus coef times the per-token reverse KL) over its policy tokens, and this rank's ``distill/*`` metrics (reduced
    over ranks with the step's other experience metrics)."""
    student_BR, mask_BR = _pad(student_R, masks)
    teacher_BR, _ = _pad(teacher_R)
    task_BR, _ = _pad(advantages)
    adv_BR = distill_advantages(task_BR, student_BR, teacher_BR, mask_BR, coef=settings.coef,
                                add_task=settings.add_task)
    return _unpad(adv_BR, advantages), distill_metrics(student_BR, teacher_BR, mask_BR)


def critic_values(model, rollouts, *, token_budget: int, device: torch.device,
                  share_prompts: bool = False) -> list[Tensor]:
    """Values at the response-scoring positions under the value model."""
    return packed_pass(model, rollouts, forward=value_token_outputs, token_budget=token_budget, device=device,
                       share_prompts=share_prompts)


def rollout_masks(rollouts: Sequence[Rollout]) -> list[Optional[Tensor]]:
    """Per rollout, bool `[R]`: its policy's response tokens (`Rollout.response_mask`); None when it has no mask."""
    out = []
    for r in rollouts:
        if r.response_mask is not None and len(r.response_mask) != len(r.response_ids):
            raise ValueError(f"a rollout's response_mask has {len(r.response_mask)} entries for "
                             f"{len(r.response_ids)} response tokens; it needs one 0/1 entry per response token")
        out.append(None if r.response_mask is None else torch.tensor([bool(m) for m in r.response_mask]))
    return out


def at_policy_tokens(values_R: Tensor, mask_R: Optional[Tensor]) -> Tensor:
    """``values_R`` with 0 where the mask is off (a tool's token); itself without a mask."""
    return values_R if mask_R is None else torch.where(mask_R, values_R, torch.zeros((), dtype=values_R.dtype))


def token_rewards(rollouts: Sequence[Rollout], *, kl_R: Optional[Sequence[Tensor]], kl_coef: float,
                  masks: Optional[Sequence[Optional[Tensor]]] = None) -> list[Tensor]:
    """Per token: the outcome reward on the last policy token (the last response token without a mask; nowhere in a
    response with no policy token), minus ``kl_coef * kl_t`` on every policy token if given; 0 at a tool's token."""
    out = []
    masks = masks if masks is not None else [None] * len(rollouts)
    for i, (rollout, mask_R) in enumerate(zip(rollouts, masks)):
        rewards_R = torch.zeros(len(rollout.response_ids), dtype=torch.float32)
        policy_positions = range(len(rollout.response_ids)) if mask_R is None else torch.nonzero(mask_R).reshape(-1)
        if len(policy_positions):
            rewards_R[int(policy_positions[-1])] = rollout.reward
        if kl_R is not None and kl_coef != 0.0:
            rewards_R = rewards_R - kl_coef * at_policy_tokens(kl_R[i], mask_R)
        out.append(rewards_R)
    return out


def reward_to_go(rewards_R: Tensor) -> Tensor:
    """Undiscounted return from each token on: ``G_t = sum_{k >= t} r_k`` (the critic's target without GAE)."""
    return torch.flip(torch.cumsum(torch.flip(rewards_R, [0]), 0), [0])


def _pad(values: Sequence[Tensor], masks: Optional[Sequence[Optional[Tensor]]] = None) -> tuple[Tensor, Tensor]:
    """``values`` right-padded to `[B, R_max]`, and the mask of the tokens that count (``masks[i]``, or all of
    sequence i's response tokens where it is None)."""
    width = max((v.numel() for v in values), default=0)
    padded_BR = torch.zeros(len(values), width, dtype=torch.float32)
    mask_BR = torch.zeros(len(values), width, dtype=torch.bool)
    for i, v in enumerate(values):
        padded_BR[i, : v.numel()] = v
        mask_BR[i, : v.numel()] = True if masks is None or masks[i] is None else masks[i]
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
    rejection: RejectionSettings = RejectionSettings()
    share_prompts: bool = False
    """The packed passes hold each prompt of a pack once (`trainer.share_prompts`)."""
    distill: Optional[DistillSettings] = None
    """On-policy distillation's advantage (``algorithm.distill``); None: no teacher."""
    routing_replay: bool = False
    """The old log-prob pass replays the routes recorded at generation (``model.moe.routing_replay``)."""


def experience_settings(cfg, *, share_prompts: bool) -> ExperienceSettings:
    """The settings of ``cfg``; resolves ``algorithm.adv_estimator`` (a built-in or a user's function)."""
    alg = cfg.algorithm
    return ExperienceSettings(
        adv_fn=resolve_adv_estimator(alg.adv_estimator),
        adv=AdvSettings(gamma=alg.gamma, lam=alg.lam, whiten_advantages=alg.whiten_advantages,
                        norm_adv_by_std=alg.norm_adv_by_std),
        kl_in_reward_coef=alg.kl_in_reward_coef, temperature=cfg.rollout.temperature,
        chunk_size=cfg.loss.logprob_chunk_size, token_budget=cfg.trainer.token_budget,
        rollout_correction=alg.rollout_correction, rollout_correction_level=alg.rollout_correction_level,
        rollout_correction_cap=alg.rollout_correction_cap, rollout_correction_low=alg.rollout_correction_low,
        rejection=rejection_settings(alg), share_prompts=share_prompts,
        distill=(DistillSettings(coef=alg.distill.coef, add_task=alg.distill.task_reward == "add")
                 if alg.distill.teacher is not None else None),
        routing_replay=cfg.model.moe.routing_replay)


def rejection_settings(alg) -> RejectionSettings:
    """The rejections ``algorithm.rollout_rejection*`` turn on (by ratio, by divergence, both or none)."""
    return RejectionSettings(alg.rollout_rejection, alg.rollout_rejection_low, alg.rollout_rejection_high,
                             alg.rollout_rejection_divergence, alg.rollout_rejection_divergence_max)


def _sum_over_ranks(stats: Tensor) -> Tensor:
    """The one all-reduce of the whitening moments (a module-level name, so a test can plant a local-only bug)."""
    return world.all_reduce_sum(stats)


def estimate_advantages(rewards_R: Sequence[Tensor], values_R: Optional[Sequence[Tensor]], rollouts, *,
                        adv_fn: Callable, settings: AdvSettings,
                        sum_across_ranks: Callable[[Tensor], Tensor] = None,
                        masks: Optional[Sequence[Optional[Tensor]]] = None) -> tuple[list, Optional[list]]:
    """Per sequence: advantages (whitened with the global moments when the estimator asks) and returns (None when
    the estimator defines none), over the policy's tokens (``masks``, per sequence; None: every response token): the
    estimator gets them as its ``mask_BT``, so GAE runs over the policy's tokens and the outcome estimators put
    their advantage there. Collective: exactly one all-reduce, whatever the estimator (its `whiten` flag rides
    along, so a function that asks on some ranks only is an error, not a hang).

    A user's function that returns the wrong type or shape is a ConfigError (exit 2).
    """
    sum_across_ranks = sum_across_ranks or _sum_over_ranks
    rewards_BR, mask_BR = _pad(rewards_R, masks)
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
    returns_BR = result.returns_BT.float() if result.returns_BT is not None else None
    if masks is not None:  # 0 at a tool's token, whatever a user's estimator left there
        adv_BR = torch.where(mask_BR, adv_BR.float(), 0.0)
        returns_BR = torch.where(mask_BR, returns_BR, 0.0) if returns_BR is not None else None
    returns = _unpad(returns_BR, rewards_R) if returns_BR is not None else None
    return _unpad(adv_BR.float(), rewards_R), returns


def _check_result(result, mask_BR: Tensor) -> None:
    if not isinstance(result, AdvantageResult):
        raise ConfigError(f"algorithm.adv_estimator returned a {type(result).__name__}; it must return "
                          "fsdptrain.rl.estimator_registry.AdvantageResult(advantages_BT, returns_BT or None, whiten)")
    for name in ("advantages_BT", "returns_BT"):
        value = getattr(result, name)
        if (value is not None or name == "advantages_BT") and (
                not isinstance(value, Tensor) or value.shape != mask_BR.shape):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ConfigError(f"algorithm.adv_estimator returned {name} of shape {shape}; it must be "
                              f"{tuple(mask_BR.shape)} (the rank's sequences x the longest response)")


def correction_weights(old_R: Sequence[Tensor], behaviour_R: Sequence[Tensor], *, mode: str, level: str,
                       cap: float, low: Optional[float] = None,
                       masks: Optional[Sequence[Optional[Tensor]]] = None) -> tuple[list[Tensor], Metrics]:
    """Rollout-correction importance weights per sequence (`rollout_correction_weights`, over the policy's tokens:
    ``masks``) and their metrics (this rank's; the caller reduces them with the step's)."""
    old_BR, mask_BR = _pad(old_R, masks)
    behaviour_BR, _ = _pad(behaviour_R)
    weights_BR, metrics = rollout_correction_weights(old_BR, behaviour_BR, mask_BR, mode=mode, level=level, cap=cap,
                                                         low=low)
    return _unpad(weights_BR, old_R), metrics.prefixed("experience/")


def off_policy_metrics(old_R: Sequence[Tensor], behaviour_R: Sequence[Optional[Tensor]],
                       masks: Optional[Sequence[Optional[Tensor]]] = None) -> Metrics:
    """``rollout_corr/*`` (`off_policy_diagnostics`: k1 and k3 KL, log-perplexity gap, share of ratios outside
    [1/2, 2]) between the trainer's old log-probs and the behaviour log-probs, over this rank's rollouts that carry
    them (the others are left out), over their policy tokens (``masks``; None: all). Means with their totals and counts, reduced over ranks with the step's other
    experience metrics, so the logged value pools every such token (``log_ppl_diff``: sequence) of the step. When no
    rollout carries behaviour log-probs the counts are 0 and the metrics are absent, never 0.0."""
    masks = masks if masks is not None else [None] * len(old_R)
    carried = [(o, b, m) for o, b, m in zip(old_R, behaviour_R, masks) if b is not None]
    old_BR, mask_BR = _pad([o for o, _, _ in carried], [m for _, _, m in carried])
    behaviour_BR, _ = _pad([b for _, b, _ in carried])
    return off_policy_diagnostics(old_BR.double(), behaviour_BR.double(), mask_BR).prefixed("rollout_corr/")


def generation_logprobs(rollouts: Sequence[Rollout]) -> list[Optional[Tensor]]:
    """Per rollout, its ``generation_logprobs`` as float32 `_R`, or None where it carries none."""
    return [None if r.generation_logprobs is None else torch.tensor(r.generation_logprobs, dtype=torch.float32)
            for r in rollouts]


def logprob_diff_metrics(old_R: Sequence[Tensor], generated_R: Sequence[Optional[Tensor]],
                         masks: Sequence[Optional[Tensor]]) -> Metrics:
    """``rollout/logprob_diff/mean`` and ``/max``: |training forward - generating forward| log-prob, over the policy
    tokens (``masks``; None: all) of this rank's rollouts that carry ``generation_logprobs`` (the others are left
    out). A token-pooled MEAN (total and count) and a MAX, reduced over ranks with the step's other experience
    metrics, so the value is the same at any dp size and packing. No rollout carries them: empty, never 0.0."""
    carried = [(o, g, m) for o, g, m in zip(old_R, generated_R, masks) if g is not None]
    if not carried:
        return Metrics({})
    diff_BR, mask_BR = _pad([(o.double() - g.double()).abs() for o, g, _ in carried], [m for _, _, m in carried])
    valid = mask_BR.bool()
    return Metrics({"rollout/logprob_diff/mean": Mean.of(diff_BR, valid),
                    "rollout/logprob_diff/max": Max.of(diff_BR, valid)})


def rejected(old_R: Sequence[Tensor], behaviour_R: Sequence[Tensor], masks: Sequence[Optional[Tensor]],
             settings: RejectionSettings) -> tuple[list[Optional[Tensor]], Metrics]:
    """Per sequence, its mask after rejection sampling (`rollout_rejection` over its policy tokens: by ratio, by
    divergence, or both) and the rejection's metrics (this rank's; the caller reduces them with the step's)."""
    old_BR, mask_BR = _pad(old_R, masks)
    behaviour_BR, _ = _pad(behaviour_R)
    keep_BR, metrics = rollout_rejection(old_BR, behaviour_BR, mask_BR, settings)
    return [keep_BR[i, : o.numel()].clone() for i, o in enumerate(old_R)], metrics.prefixed("experience/")


def _replica_sum(stats: Tensor) -> Tensor:
    """`_sum_over_ranks` from a rank whose rollouts another rank of its CP group also holds: it adds nothing."""
    return _sum_over_ranks(torch.zeros_like(stats))


def make_targets(models, rollouts: Sequence[Rollout], settings: ExperienceSettings, *, device: torch.device,
                 skip_old_passes: bool = False, replica: bool = False) -> tuple[list[SeqTargets], bool, Metrics]:
    """Old/ref log-probs, values, rewards, advantages, returns and importance weights for this rank's rollouts.

    Collective (packed passes, one all-reduce). Returns the targets, whether the step is on-policy (no rollout
    carries behaviour log-probs), and this rank's experience metrics (``rollout_corr/*`` always, empty means when no
    rollout carries behaviour log-probs; ``experience/rollout_is_*`` with a rollout correction).
    ``skip_old_passes`` (strictly on-policy updates only, see fsdptrain/train/setup.py `skips_old_passes`): the old
    log-probs, and the critic's old values when the estimator does not read them, are left None; the first update
    forward's detached outputs stand in for them, which is what the passes would have computed.
    ``replica``: another rank (its CP group's first) holds the same rollouts; its whitening moments count once.
    """
    sum_across_ranks = _replica_sum if replica else None
    budget = settings.token_budget
    logprob_args = dict(temperature=settings.temperature, chunk_size=settings.chunk_size, token_budget=budget,
                        device=device, share_prompts=settings.share_prompts)
    if skip_old_passes:
        return _on_policy_targets(models, rollouts, settings, logprob_args, sum_across_ranks)
    masks = rollout_masks(rollouts)
    old, route_metrics = routed_policy_logprobs(models.policy, rollouts, replay=settings.routing_replay,
                                                **logprob_args)
    behaviour = [torch.tensor(r.behaviour_logprobs, dtype=torch.float32) if r.behaviour_logprobs is not None
                 else None for r in rollouts]
    on_policy = all(b is None for b in behaviour)
    behaviour_or_old = [b if b is not None else o for b, o in zip(behaviour, old)]  # none carried: ratio 1
    weights, kept, metrics = _off_policy_corrections(old, behaviour_or_old, masks, settings)
    generated = generation_logprobs(rollouts)
    metrics = merge_all([off_policy_metrics(old, behaviour, masks), logprob_diff_metrics(old, generated, masks),
                         route_metrics, metrics])
    if settings.rollout_correction == "none":  # without a correction the behaviour log-probs are the old policy's
        old = behaviour_or_old
    ref = reference_logprobs(models.reference, rollouts, **logprob_args)
    values = (critic_values(models.critic, rollouts, token_budget=budget, device=device,
                            share_prompts=settings.share_prompts) if models.critic is not None else None)
    advantages, returns = advantages_and_returns(rollouts, old, ref, values, masks, settings,
                                                 sum_across_ranks=sum_across_ranks)
    teacher = teacher_logprobs(models.teacher, rollouts, **logprob_args)
    if teacher is not None:  # the student's log-probs are the old ones (the sampler's, when rollouts carry them)
        advantages, distill_facts = distilled(advantages, old, teacher, masks, settings.distill)
        metrics = metrics.merge(distill_facts)
    targets = [_targets(old_logprobs=old[i], advantages=advantages[i],
                        ref_logprobs=ref[i] if ref is not None else None,
                        old_values=values[i] if values is not None else None,
                        returns=returns[i] if values is not None else None,
                        is_weights=weights[i] if weights is not None else None,
                        policy_mask=masks[i], response_mask=kept[i])
               for i in range(len(rollouts))]
    return targets, on_policy, metrics


def advantages_and_returns(rollouts: Sequence[Rollout], old: Sequence[Tensor], ref: Optional[Sequence[Tensor]],
                           values: Optional[Sequence[Tensor]], masks: Sequence[Optional[Tensor]],
                           settings: ExperienceSettings, *, sum_across_ranks=None) -> tuple[list, Optional[list]]:
    """Per sequence, the advantages and the returns (None without ``values``) from the old and the reference
    log-probs (the KL-in-reward penalty of `token_rewards`) and the critic's values: the estimator's
    (`estimate_advantages`), with the undiscounted reward-to-go where it defines no returns. Collective (its one
    all-reduce). A function of its inputs only: check-metrics also runs it on perturbed ones, where the reference
    differs from the policy (fsdptrain/check/passes.py)."""
    kl_R = [o - r for o, r in zip(old, ref)] if ref is not None else None
    rewards = token_rewards(rollouts, kl_R=kl_R, kl_coef=settings.kl_in_reward_coef, masks=masks)
    any_mask = any(m is not None for m in masks)
    advantages, returns = estimate_advantages(rewards, values, rollouts, adv_fn=settings.adv_fn, settings=settings.adv,
                                              masks=masks if any_mask else None, sum_across_ranks=sum_across_ranks)
    if values is not None and returns is None:
        returns = [at_policy_tokens(reward_to_go(r), m) for r, m in zip(rewards, masks)]
    return advantages, returns


def _off_policy_corrections(old: list[Tensor], behaviour: list[Tensor], masks: list[Optional[Tensor]],
                            settings: ExperienceSettings
                            ) -> tuple[Optional[list[Tensor]], list[Optional[Tensor]], Metrics]:
    """From the trainer's old and the behaviour log-probs: the rollout-correction weights (None without one), the
    masks after rejection sampling (the rollouts' without it) and this rank's metrics of both."""
    weights, kept, metrics = None, masks, Metrics({})
    if settings.rollout_correction != "none":
        weights, metrics = correction_weights(old, behaviour, mode=settings.rollout_correction,
                                              level=settings.rollout_correction_level,
                                              cap=settings.rollout_correction_cap, low=settings.rollout_correction_low,
                                              masks=masks if any(m is not None for m in masks) else None)
    if settings.rejection.active:
        kept, rejection_metrics = rejected(old, behaviour, masks, settings.rejection)
        metrics = metrics.merge(rejection_metrics)
    return weights, kept, metrics


def _targets(*, policy_mask: Optional[Tensor], response_mask: Optional[Tensor], **per_token) -> SeqTargets:
    """SeqTargets whose every per-token entry is 0 at a tool's token (``policy_mask`` off); ``response_mask``: the
    tokens that count (the policy's, less the rejected ones)."""
    if policy_mask is None and response_mask is None:
        return SeqTargets(**per_token)
    zeroed = {k: v if v is None else at_policy_tokens(v, policy_mask) for k, v in per_token.items()}
    return SeqTargets(**zeroed, response_mask=response_mask)


def _on_policy_targets(models, rollouts: Sequence[Rollout], settings: ExperienceSettings,
                       logprob_args: dict, sum_across_ranks=None) -> tuple[list[SeqTargets], bool, Metrics]:
    """`make_targets` without the old log-prob pass (and without the critic's pass when the built-in estimator reads
    no values): no behaviour log-probs, no KL in the reward, no rollout correction (the caller guarantees it). The
    targets carry the generation log-probs, whose gap the first update forward logs instead of the pass
    (`fsdptrain.rl.fused_loss.generation_gap_metrics`)."""
    masks = rollout_masks(rollouts)
    generated = generation_logprobs(rollouts)
    any_mask = any(m is not None for m in masks)
    ref = reference_logprobs(models.reference, rollouts, **logprob_args)
    rewards = token_rewards(rollouts, kl_R=None, kl_coef=0.0, masks=masks)
    needs_values = models.critic is not None and settings.adv_fn is ADV_ESTIMATOR_REGISTRY["gae"]
    values = (critic_values(models.critic, rollouts, token_budget=logprob_args["token_budget"],
                            device=logprob_args["device"], share_prompts=settings.share_prompts)
              if needs_values else None)
    advantages, returns = estimate_advantages(rewards, values, rollouts, adv_fn=settings.adv_fn, settings=settings.adv,
                                              masks=masks if any_mask else None, sum_across_ranks=sum_across_ranks)
    if models.critic is not None and returns is None:
        returns = [at_policy_tokens(reward_to_go(r), m) for r, m in zip(rewards, masks)]
    targets = [_targets(old_logprobs=None, advantages=advantages[i],
                        ref_logprobs=ref[i] if ref is not None else None,
                        old_values=values[i] if values is not None else None,
                        returns=returns[i] if models.critic is not None else None,
                        generation_logprobs=generated[i], policy_mask=masks[i], response_mask=masks[i])
               for i in range(len(rollouts))]
    return targets, True, Metrics({})
