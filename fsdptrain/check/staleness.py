"""check-metrics on a ``rollout.placement=separate`` config: the generators' staleness emulated in one process with the
trainer's own parts (docs/check-metrics.md, "A separate-placement config").

check-metrics launches no generator rank: every launched rank is a checked trainer rank, built from a colocated copy
of the config (:func:`as_colocated`). A generator samples each trainer rank's groups exactly as that rank would
colocated (the same sampler, engine and seeds), with the weights of version ``max(0, t - k)`` for step ``t``
(fsdptrain/generation/schedule.py), so:

- k = 0: the generator holds the trainer's own weights; the checked batch is the colocated one, and the product's
  :func:`~fsdptrain.rollout.prompt_source.stale_behaviour` leaves it on-policy;
- k >= 1: the batch is sampled with the current weights (version 0; the raw reference's recorder keeps each token's
  log-prob as the generating forward computed it), then k of the trainer's own updates on that batch (its real
  optimiser) make the weights version k, as at step k. The product's ``stale_behaviour`` gives the rollouts their
  behaviour log-probs, the experience is made from them at version k (off-policy: the old pass runs), and every
  layout runs on that batch. :func:`behaviour_checks` compares the behaviour log-probs the experience used with the
  recorded ones, so an experience that takes the current weights' log-probs as the behaviour's fails.

Left out: what moves between the ranks (the weights' buckets, the samples, the checkpointed in-flight rollouts) and
the generator's own unsharded policy in ``parallel.param_dtype``; those are end-to-end tests of the training run.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.check.compare import Check
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.rollout import prompt_source
from fsdptrain.train.experience import policy_logprobs
from fsdptrain.train.rl import Trainer

BEHAVIOUR_RULE = "experience: behaviour log-probs = the generating forward's (weights of version t - k)"


def separate_staleness(cfg: DictConfig) -> Optional[int]:
    """``rollout.max_staleness`` (k) of a ``rollout.placement=separate`` config; None for a colocated one."""
    return cfg.rollout.max_staleness if cfg.rollout.placement == "separate" else None


def as_colocated(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with ``rollout.placement=colocated`` (and its generator settings at their defaults): the
    trainer check-metrics builds samples itself and talks to no generator."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plain.rollout.placement, plain.rollout.max_staleness, plain.rollout.generator_ranks = "colocated", 0, 1
    return plain


def made_stale(trainer: Trainer, rollouts: list[Rollout], *, max_staleness: int) -> list[Rollout]:
    """After ``max_staleness`` of the trainer's own updates on ``rollouts`` (experience, mini-batches, the update with
    its optimiser; collective), the rollouts as the product hands stale ones to the experience
    (:func:`~fsdptrain.rollout.prompt_source.stale_behaviour`): sampled by version 0, trained at version k."""
    for _ in range(max_staleness):
        targets, facts = trainer.make_experience(rollouts)
        trainer.update(trainer.minibatches(rollouts, targets), facts["on_policy"])
    return prompt_source.stale_behaviour(rollouts, max_staleness=max_staleness)  # looked up now: the product's


def behaviour_checks(trainer: Trainer, rollouts: list[Rollout], targets: list[SeqTargets],
                     carried: list[Optional[torch.Tensor]], recorded: list[list[float]],
                     policy_masks: list[list[bool]], *, corrected: bool,
                     max_staleness: int) -> tuple[list[Check], list[str]]:
    """With ``max_staleness`` k > 0, the behaviour log-probs this rank's experience used against the generating
    forward's (``recorded``), on the policy's tokens, within ``atol + rtol * |recorded|``: one check over every
    rank's tokens, and the notes (collective); none at k = 0. Without a rollout correction (``corrected``) the
    experience used them as the targets' old log-probs; with one, as the rollouts ``carried`` them into the
    experience (the correction's own rows then compare its weights with the reference's from these). The check's
    detail gives the largest gap between the current weights' (version k) log-probs and the recorded ones: what a
    behaviour taken from the current weights would differ by (0: the check proves nothing, a note says so)."""
    if not max_staleness:
        return [], []
    used = carried if corrected else [t.old_logprobs for t in targets]
    what = "the carried ones" if corrected else "the old log-probs"
    rtol, atol = trainer.cfg.check.rtol, trainer.cfg.check.atol
    exp = trainer.experience_settings
    current = policy_logprobs(trainer.models.policy, rollouts, temperature=exp.temperature, chunk_size=exp.chunk_size,
                              token_budget=exp.token_budget, device=trainer.device)
    bad, total, worst, gap = 0, 0, 0.0, 0.0
    for got, want, now, mask in zip(used, recorded, current, policy_masks, strict=True):
        n = sum(mask)
        total += n
        if got is None or got.numel() != len(mask) or len(want) != len(mask):  # carried none, or another length
            bad, worst = bad + n, math.inf if n else worst
            continue
        got, now = got.double().tolist(), now.double().tolist()
        for j in (j for j, keep in enumerate(mask) if keep):
            diff = abs(got[j] - want[j])
            bad += not diff <= atol + rtol * abs(want[j])  # a NaN fails
            worst = max(worst, math.inf if math.isnan(diff) else diff)
            gap = max(gap, abs(now[j] - want[j]))
    counts = world.all_reduce_sum(torch.tensor([bad, total], dtype=torch.float64))
    worst, gap = world.all_reduce_max(torch.tensor([worst, gap], dtype=torch.float64)).tolist()
    bad, total = int(counts[0]), int(counts[1])
    detail = (f"{bad} of {total} policy tokens differ, max |diff| {worst:.3g} ({what} against the recorded "
              f"generation log-probs); the current weights' log-probs differ from those by up to {gap:.3g}")
    notes = [f"rollout.placement=separate, rollout.max_staleness={max_staleness}: every launched rank is a checked "
             f"trainer rank; the batch was sampled by the weights of version 0 and its experience made after "
             f"{max_staleness} of the trainer's own updates on it (version {max_staleness}), off-policy with the "
             "generation log-probs as the behaviour's"]
    if gap <= atol:
        notes.append("the updates did not move the policy's log-probs: the behaviour check proves nothing here")
    return [Check(BEHAVIOUR_RULE, "experience", worst, bad == 0 and total > 0, detail)], notes


ON_POLICY_NOTE = ("rollout.placement=separate, rollout.max_staleness=0: the generator ranks sample exactly what each "
                  "trainer rank would colocated, with its weights, so the checked batch is the colocated config's "
                  "(every launched rank is a checked trainer rank)")
