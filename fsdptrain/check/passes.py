"""check-metrics, part 6: what the battery adds to the configured check, whatever the user configured.

- The **off-policy pass**: the first mini-batch is on-policy (ratio 1, reference = policy), where clip bounds,
  dual-clip, clip-higher, the KL estimators and importance weights never bind. This pass reruns every layout on the
  same sequences with the old log-probs, the reference log-probs, the old values and the advantages perturbed by
  seeded amounts (:data:`OFF_POLICY_SEED`; the advantages by their own generator, :data:`ADVANTAGE_SEED`, so that a
  batch whose every advantage is 0, as GRPO gives when each group's rewards are equal, still has a policy gradient
  to compare), rollout-correction weights from a perturbed behaviour policy, and loss settings that
  switch those paths on: asymmetric clip (clip_ratio_high + 0.08 when the bounds are equal), dual-clip (3.0 when off,
  vanilla loss), the KL loss (the configured estimator and clamp, coefficient at least 0.001), importance weights
  (the configured correction, else tis per token with cap 2) and a sampling temperature of 0.7 when 1 is configured.
- The **experience checks**: the batch's advantages and returns against :mod:`fsdptrain.check.experience_reference`,
  then the product's estimator rerun on the real ranks with gamma = 0.9, lambda = 0.8 (so a swap shows) against the
  oracle with those settings, then the product's rewards, advantages and returns (`advantages_and_returns`) on the
  off-policy pass's perturbed old and reference log-probs and values against the oracle on the same inputs: on the
  generated batch the reference is the policy, so the KL penalty in the reward is 0 there and a wrong sign or
  coefficient of it would pass (the configured ``algorithm.kl_in_reward_coef``, else 0.1, so the path always runs).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fsdptrain.check.batch import CheckBatch, CheckSession, IsCorrection
from fsdptrain.check.compare import Check
from fsdptrain.check.per_sequence import reference_policy_outputs
from fsdptrain.check.experience_reference import OracleSettings, SeqInputs, max_difference, oracle_experience
from fsdptrain.distributed import world
from fsdptrain.rl.fused_loss import SeqTargets, ValueLossSettings
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.rl.rollout_correction import rollout_correction_weights
from fsdptrain.train.experience import advantages_and_returns, estimate_advantages, rollout_masks, token_rewards

OFF_POLICY_SEED = 20_250_515
OLD_SPREAD, REF_SPREAD, BEHAVIOUR_SPREAD, VALUE_SPREAD = 1.5, 4.0, 1.0, 0.5
"""Uniform perturbations: old log-probs +-1.5 (ratios in [0.22, 4.5]: both clip bounds and dual-clip at 3 bind),
reference +-4 (k3 above its clamp of 10 for d < -2.5), behaviour +-1 (weights above a cap of 2), old values +-0.5."""
ADVANTAGE_SEED, ADVANTAGE_SPREAD = 20_261_206, 1.0
"""Advantages +-1: both signs, so the clip bounds and dual-clip bind on the policy-gradient term."""
PROBE_GAMMA, PROBE_LAM = 0.9, 0.8
PROBE_KL_IN_REWARD_COEF = 0.1
"""The KL-in-reward coefficient of the perturbed experience check when none is configured (the path still runs)."""
OFF_POLICY_TEMPERATURE = 0.7


def _noise(gen: torch.Generator, like: torch.Tensor, spread: float) -> torch.Tensor:
    return (torch.rand(like.shape, generator=gen, dtype=torch.float64) * 2 - 1).to(like.dtype) * spread


def off_policy_batch(batch: CheckBatch, *, correction: str, level: str, cap: float,
                     low: Optional[float] = None) -> CheckBatch:
    """The batch with seeded perturbations of every sequence's targets (the same on every rank: drawn in ``full``'s
    order) and rollout-correction weights made by the product's ``rollout_correction_weights`` (what the layouts
    use); the behaviour log-probs ride along, for the reference to make its own weights from their definitions."""
    gen = torch.Generator().manual_seed(OFF_POLICY_SEED)
    advantage_gen = torch.Generator().manual_seed(ADVANTAGE_SEED)
    targets, behaviours = [], []
    for t, policy in zip(batch.full.targets, batch.policy_token_masks()):
        old = t.old_logprobs + _noise(gen, t.old_logprobs, OLD_SPREAD)
        ref = (t.ref_logprobs if t.ref_logprobs is not None else t.old_logprobs) + _noise(gen, old, REF_SPREAD)
        behaviour = old + _noise(gen, old, BEHAVIOUR_SPREAD)
        weights, _ = rollout_correction_weights(old[None], behaviour[None], torch.tensor(policy, dtype=torch.bool)[None],
                                                mode=correction, level=level, cap=cap, low=low)
        values = None if t.old_values is None else t.old_values + _noise(gen, t.old_values, VALUE_SPREAD)
        advantages = t.advantages + _noise(advantage_gen, t.advantages, ADVANTAGE_SPREAD)
        targets.append(dataclasses.replace(t, old_logprobs=old, ref_logprobs=ref, old_values=values,
                                           advantages=advantages, is_weights=weights[0]))
        behaviours.append(behaviour)
    return dataclasses.replace(batch.with_targets(targets), behaviour=behaviours,
                               correction=IsCorrection(correction, level, cap, low))


def off_policy_settings(policy: PolicyLossSettings) -> PolicyLossSettings:
    """The configured policy settings with every off-policy path switched on (see the module docstring)."""
    high = policy.clip_ratio_high + 0.08 if policy.clip_ratio_high == policy.clip_ratio_low else policy.clip_ratio_high
    dual = policy.clip_ratio_c
    if dual is None and policy.policy_loss == "vanilla":
        dual = 3.0
    temperature = OFF_POLICY_TEMPERATURE if policy.temperature == 1.0 else policy.temperature
    return dataclasses.replace(policy, clip_ratio_high=high, clip_ratio_c=dual, use_reference=True,
                               kl_coef=max(policy.kl_coef, 0.001), use_is_weights=True, temperature=temperature)


def off_policy_value_settings(value: ValueLossSettings) -> ValueLossSettings:
    return value if value.cliprange_value is not None else dataclasses.replace(value, cliprange_value=0.2)


# ---- experience ---------------------------------------------------------------------------------------------------


def _inputs(batch: CheckBatch, indices: list[int]) -> list[SeqInputs]:
    out = []
    for i in indices:
        t = batch.full.targets[i]
        out.append(SeqInputs(score=batch.scores[i], group=batch.groups[i], old=t.old_logprobs.double().tolist(),
                             ref=None if t.ref_logprobs is None else t.ref_logprobs.double().tolist(),
                             values=None if t.old_values is None else t.old_values.double().tolist(),
                             policy=batch.policy_token_masks()[i]))
    return out


def _oracle_settings(cfg, *, gamma: float, lam: float) -> OracleSettings:
    alg = cfg.algorithm
    return OracleSettings(alg.adv_estimator, gamma, lam, alg.whiten_advantages, alg.norm_adv_by_std,
                          alg.kl_in_reward_coef if alg.use_kl_loss or alg.kl_in_reward_coef > 0 else 0.0)


def _check(rule: str, got: list, want: list, *, rtol: float, atol: float) -> Check:
    diff, scale = max_difference(got, want)
    tolerance = atol + rtol * max(scale, 1.0)
    return Check(rule, "experience", diff, diff <= tolerance, f"max |diff| {diff:.3g} (tolerance {tolerance:.3g})")


def experience_checks(session: CheckSession, *, rtol: float, atol: float) -> tuple[list[Check], Optional[str]]:
    """The experience checks (collective: the probe runs the product's estimator on the real ranks), and a note when
    the estimator is a user's function (no oracle)."""
    cfg, batch = session.cfg, session.batch
    real = list(range(len(batch.scores)))
    inputs = _inputs(batch, real)
    want = oracle_experience(inputs, _oracle_settings(cfg, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam))
    probe_local = _probe(session)  # collective: every rank runs it, whatever the estimator
    perturbed = _perturbed_experience(session, rtol=rtol, atol=atol)  # collective too
    if want is None:
        return [], (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} is a user's function: its advantages "
                    "are not recomputed (no oracle)")
    got = [batch.full.targets[i] for i in real]
    checks = []
    if session.trainer.models.teacher is not None:  # collective: every rank runs the same per-sequence forwards
        want, distill_checks = _distilled_oracle(session, inputs, want, rtol=rtol, atol=atol)
        checks += distill_checks
    checks += [_check("experience: advantages = oracle (global whitening)", [t.advantages.double().tolist() for t in got],
                     [w[0] for w in want], rtol=rtol, atol=atol)]
    if want[0][1] is not None:
        checks.append(_check("experience: returns = oracle", [t.returns.double().tolist() for t in got],
                             [w[1] for w in want], rtol=rtol, atol=atol))
    probe_want = oracle_experience(inputs, _oracle_settings(cfg, gamma=PROBE_GAMMA, lam=PROBE_LAM))
    mine = [i for i in batch.local_index if i < len(real)]
    checks.append(_over_ranks(f"experience: advantages = oracle at gamma={PROBE_GAMMA}, lambda={PROBE_LAM} on the "
                              "real ranks", [a for a, _ in probe_local], [probe_want[i][0] for i in mine],
                              rtol=rtol, atol=atol))
    return checks + perturbed(), None


def _over_ranks(rule: str, got: list, want: list, *, rtol: float, atol: float) -> Check:
    """One check of this rank's sequences, agreed over the ranks (collective): the largest difference, and a pass
    only where every rank passed."""
    local = _check("", got, want, rtol=rtol, atol=atol)
    worst = float(world.all_reduce_max(torch.tensor([local.value], dtype=torch.float64))[0])
    ok = world.agree_max_int(0 if local.passed else 1) == 0
    return Check(rule, "experience", worst, ok, f"max |diff| {worst:.3g}")


def _perturbed_experience(session: CheckSession, *, rtol: float, atol: float):
    """The product's advantages and returns (`advantages_and_returns`) of this rank's real sequences on the
    off-policy pass's perturbed batch (:func:`off_policy_batch`: old and reference log-probs, values), at the
    configured gamma and lambda and the KL-in-reward coefficient (:data:`PROBE_KL_IN_REWARD_COEF` when 0), run here
    (collective); returns what compares them with the oracle on the same inputs (collective too; no check for a
    user's estimator, which has no oracle)."""
    cfg, batch, tr = session.cfg, session.batch, session.trainer
    perturbed = off_policy_batch(batch, correction="tis", level="token", cap=2.0)  # the weights are not read here
    coef = cfg.algorithm.kl_in_reward_coef or PROBE_KL_IN_REWARD_COEF
    mine = [i for i in batch.local_index if i < len(batch.scores)]
    targets = [perturbed.full.targets[i] for i in mine]
    rollouts = [_Scored(batch.scores[i], batch.groups[i], [int(m) for m in batch.policy_token_masks()[i]],
                        [0] * len(batch.full.responses[i])) for i in mine]
    values = [t.old_values for t in targets] if tr.models.critic is not None else None
    got_adv, got_ret = advantages_and_returns(
        rollouts, [t.old_logprobs for t in targets], [t.ref_logprobs for t in targets], values,
        rollout_masks(rollouts), dataclasses.replace(tr.experience_settings, kl_in_reward_coef=coef))
    settings = dataclasses.replace(_oracle_settings(cfg, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam),
                                   kl_in_reward_coef=coef)
    want = oracle_experience(_inputs(perturbed, list(range(len(batch.scores)))), settings)
    what = f"on the perturbed batch (old, reference, values; KL-in-reward coef {coef:g})"

    def compare() -> list[Check]:
        if want is None:
            return []
        checks = [_over_ranks(f"experience: advantages = oracle {what}", [a.double().tolist() for a in got_adv],
                              [want[i][0] for i in mine], rtol=rtol, atol=atol)]
        if got_ret is not None and want[0][1] is not None:  # the oracle's returns: a critic's targets
            checks.append(_over_ranks(f"experience: returns = oracle {what}", [r.double().tolist() for r in got_ret],
                                      [want[i][1] for i in mine], rtol=rtol, atol=atol))
        return checks

    return compare


def _distilled_oracle(session: CheckSession, inputs: list[SeqInputs], want: Optional[list], *, rtol: float,
                      atol: float) -> tuple[Optional[list], list[Check]]:
    """The oracle's advantages with distillation's term (docs/algorithms.md: ``[add] A_task - coef * (old -
    teacher)`` at policy tokens), the teacher's log-probs from one-sequence-at-a-time forwards, and ``distill/*``
    (as the step logged them, reduced over ranks) against their definitions over every policy token."""
    batch, trainer = session.batch, session.trainer
    alg = session.cfg.algorithm.distill
    with torch.no_grad():
        teachers = [reference_policy_outputs(trainer.models.teacher, batch.full.prompts[i], batch.full.responses[i],
                                             temperature=trainer.experience_settings.temperature)[0].double().tolist()
                    if batch.full.responses[i] else [] for i in range(len(inputs))]
    kls, teacher_at_policy = [], []
    out = None if want is None else []
    for k, (q, teacher) in enumerate(zip(inputs, teachers)):
        kl = [o - t for o, t in zip(q.old, teacher)]
        policy = q.policy if q.policy is not None else [True] * len(kl)
        kls += [x for x, p in zip(kl, policy) if p]
        teacher_at_policy += [t for t, p in zip(teacher, policy) if p]
        if out is not None:
            task = want[k][0] if alg.task_reward == "add" else [0.0] * len(kl)
            out.append(([a - alg.coef * x if p else 0.0 for a, x, p in zip(task, kl, policy)], want[k][1]))
    expected = {"distill/reverse_kl_mean": sum(kls) / len(kls), "distill/reverse_kl_max": max(kls),
                "distill/teacher_logprob_mean": sum(teacher_at_policy) / len(teacher_at_policy)}
    checks = [_check(f"experience: {name} = its definition", [[batch.experience.get(name, float("inf"))]], [[value]],
                     rtol=rtol, atol=atol) for name, value in expected.items()]
    return out, checks


def _probe(session: CheckSession) -> list[tuple[list[float], Optional[list[float]]]]:
    """This rank's advantages from the product's own estimator path with the probe's gamma and lambda."""
    batch, tr = session.batch, session.trainer
    exp = tr.experience_settings
    mine = [i for i in batch.local_index if i < len(batch.scores)]
    targets: list[SeqTargets] = [batch.full.targets[i] for i in mine]
    rollouts = [_Scored(batch.scores[i], batch.groups[i], [int(m) for m in batch.policy_token_masks()[i]],
                        [0] * len(batch.full.responses[i])) for i in mine]
    masks = rollout_masks(rollouts)
    kl_R = [t.old_logprobs - t.ref_logprobs if t.ref_logprobs is not None else None for t in targets]
    rewards = token_rewards(rollouts, kl_R=kl_R if all(k is not None for k in kl_R) else None,
                            kl_coef=exp.kl_in_reward_coef, masks=masks)
    values = [t.old_values for t in targets] if tr.models.critic is not None else None
    settings = dataclasses.replace(exp.adv, gamma=PROBE_GAMMA, lam=PROBE_LAM)
    adv, ret = estimate_advantages(rewards, values, rollouts, adv_fn=exp.adv_fn, settings=settings, masks=masks)
    return [(a.double().tolist(), None if ret is None else ret[k].double().tolist()) for k, a in enumerate(adv)]


@dataclasses.dataclass(frozen=True)
class _Scored:
    """What the product's reward and estimator paths read of a rollout."""

    reward: float
    group: int
    response_mask: list[int]
    response_ids: list[int]

