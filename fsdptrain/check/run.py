"""``fsdptrain check-metrics``: the same mini-batch in many layouts, compared with a one-sequence-at-a-time reference.

On every rank: build the models and one mini-batch of experience as ``fsdptrain train`` does
(:mod:`fsdptrain.check.batch`), run the reference (:mod:`fsdptrain.check.reference`) and every layout
(:mod:`fsdptrain.check.layouts`) forward and backward with no optimiser step, for the policy and the critic, and
compare the loss, the gradient (the trainer's logged norm and clip, largest entry difference) and every
non-DIAGNOSTIC metric (:mod:`fsdptrain.check.compare`); then the off-policy pass and the experience checks
(:mod:`fsdptrain.check.passes`), the rollout-correction weights, the update over several mini-batches and epochs
(:mod:`fsdptrain.check.update_pass`) and the drafter. Rank 0 prints the report (:mod:`fsdptrain.check.report`) and
writes ``--json``. Exit code 0 when everything passes, 1 when anything fails (docs/check-metrics.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from omegaconf import DictConfig

from fsdptrain.check.batch import CheckBatch, CheckSession, build_session, reference_divergences
from fsdptrain.check.compare import (
    Check,
    Comparison,
    Outcome,
    compare,
    describe_error,
    raised,
    self_checks,
    worst_of,
)
from fsdptrain.check.draft_check import PREFIX as DRAFTER
from fsdptrain.check.draft_check import (
    draft_part_settings,
    packed_draft_part_loss,
    per_sequence_draft_part_loss,
    reference_drafter,
)
from fsdptrain.check.layouts import (
    CLIP_PROBE,
    Context,
    Part,
    clip_coefficient,
    grad_max_abs,
    grad_max_diff,
    grad_norm,
    layouts,
    padded_policy_loss,
    padded_value_loss,
    real_ranks,
    token_mean_grad_norm,
    trainer_clip,
)
from fsdptrain.check.per_sequence import per_sequence_policy_loss, per_sequence_value_loss, reference_policy_outputs
from fsdptrain.check.passes import (
    experience_checks,
    off_policy_batch,
    off_policy_settings,
    off_policy_value_settings,
)
from fsdptrain.check.reference import (
    Counts,
    reference_critic,
    reference_is_metrics,
    reference_is_weights,
    reference_off_policy_metrics,
    reference_policy,
    reference_rejection_ratio_mean,
    reference_rollout_metrics,
)
from fsdptrain.check.precision import checked_precision
from fsdptrain.check.progress import Progress
from fsdptrain.check.report import OFF, CheckReport, GradScale, exit_code, print_report, write_report_json
from fsdptrain.check.update_pass import update_pass
from fsdptrain.config import validate_world
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import held_grads, reset_after_error, zero_grads
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.grad_scale import GradScaleReport, grad_scale_report
from fsdptrain.metrics.typed import comparable, finalize
from fsdptrain.check.moe_reference import reference_moe_norms
from fsdptrain.rl.moe_aux_loss import MoeNormalizers
from fsdptrain.train.setup import resolve_device_type, resolve_share_prompts
from fsdptrain.train.pack_losses import packed_policy_loss, packed_value_loss

ROLLOUT_PREFIXES = ("reward/", "response_length/", "batch/")
EV_NAME = "critic/vf_explained_var"


def parts_of(session: CheckSession, mode: str) -> list[Part]:
    """The policy and, when the algorithm has one, the critic, with the loss settings for ``mode``."""
    tr = session.trainer
    # generation_gap off: the gap between generation and training (rollout/logprob_diff/*, moe/topk_differ/*) is
    # measured on the one forward the update makes, against the generation's record, not a quantity a layout shapes
    out = [Part("actor/", tr.models.policy, replace(tr.policy_settings, agg_mode=mode, generation_gap=False),
                packed_policy_loss, per_sequence_policy_loss, padded_policy_loss,
                moe_coef=tr.models.policy_part.moe_coef)]
    if tr.models.critic is not None:
        out.append(Part("critic/", tr.models.critic, replace(tr.value_settings, agg_mode=mode), packed_value_loss,
                        per_sequence_value_loss, padded_value_loss))
    drafter = tr.auxiliary_loss()
    if drafter is not None:  # the co-trained drafter: its per-sequence oracle also stands in for a padded path
        settings = draft_part_settings(tr.models.policy, out[0].settings, drafter.loss, session.batch.full)
        out.append(Part(DRAFTER, drafter.module, settings, packed_draft_part_loss, per_sequence_draft_part_loss,
                        per_sequence_draft_part_loss))
    return out


def checked_policy_and_critic(parts: list[Part]) -> list[Part]:
    """The parts the off-policy pass and the gradient-scale report cover (not the drafter)."""
    return [p for p in parts if p.prefix != DRAFTER]


def _reference(session: CheckSession, parts: list[Part], counts: Counts):
    values, scales, grads = {}, {}, {}
    for part in parts:
        zero_grads(part.model)
        if part.prefix == DRAFTER:
            loss, metrics, grads[DRAFTER] = reference_drafter(part.model, session.batch.full, part.settings,
                                                              counts.loss_scale_factor,
                                                              counted=session.batch.counted_masks())
            norm = grad_norm(grads[DRAFTER])
            values.update(metrics, **{DRAFTER + "grad_norm": norm, DRAFTER + "grad_max_diff": 0.0,
                                      DRAFTER + "clip_coef": clip_coefficient(norm, CLIP_PROBE * norm)})
            scales[DRAFTER + "grad_max_diff"] = grad_max_abs(grads[DRAFTER])
            continue
        if part.prefix == "actor/":
            loss, metrics, loss_scales = reference_policy(part.model, session.batch.full, part.settings, counts,
                                                          counted=session.batch.counted_masks(),
                                                          behaviour=session.batch.behaviour,
                                                          correction=session.batch.correction,
                                                          policy_masks=session.batch.policy_token_masks(),
                                                          moe=_reference_moe(part, session.batch.full))
        else:
            loss, metrics, loss_scales = reference_critic(part.model, session.batch.full, part.settings, counts,
                                                          counted=session.batch.counted_masks())
        scales.update({part.prefix + k: v for k, v in loss_scales.items()})
        grads[part.prefix] = held_grads(part.model)
        values[part.prefix + "loss"] = loss
        values[part.prefix + "grad_norm"] = norm = grad_norm(grads[part.prefix])
        values[part.prefix + "clip_coef"] = clip_coefficient(norm, CLIP_PROBE * norm)
        values[part.prefix + "grad_max_diff"] = 0.0
        scales[part.prefix + "grad_max_diff"] = grad_max_abs(grads[part.prefix])
        values.update({part.prefix + k: v for k, v in metrics.items()})
    values.update(reference_rollout_metrics(session.batch.facts))
    return Outcome("reference", values, covers=()), scales, grads


def _reference_moe(part: Part, batch) -> Optional[MoeNormalizers]:
    """An MoE policy's load-balancing counts of ``batch`` by the reference's own forwards; None for a dense one."""
    return None if part.moe_coef is None else reference_moe_norms(part.model, batch, part.moe_coef)


def _scale_report(session: CheckSession, mode: str, counts: Counts) -> GradScaleReport:
    """The gradient-scale report of ``mode`` on this batch (docs/loss.md)."""
    return grad_scale_report(mode, num_tokens=counts.num_tokens, num_seqs=counts.num_seqs,
                             seq_lengths=[sum(m) for m in session.batch.counted_masks()],
                             dp_size=session.world_size, loss_scale_factor=counts.loss_scale_factor,
                             grad_clip=session.cfg.trainer.grad_clip)


def _grad_scale(scale: GradScale, parts: list[Part], ctx: Context, mode: str,
                reference: Outcome) -> tuple[dict[str, float], dict[str, float]]:
    """Per model, the expected and the measured ratio of the gradient norm to token-mean's (absent for
    seq-mean-token-mean, which reweights instead of scaling, or a zero gradient); records the norms in ``scale``."""
    expected, measured = {}, {}
    for part in parts:
        norm = reference.values[part.prefix + "grad_norm"]
        token_mean = norm if mode == "token-mean" else token_mean_grad_norm(part, ctx)
        scale.measured[part.prefix] = (norm, token_mean)
        if scale.report.scale is not None and token_mean > 0:
            name = "grad_scale/" + part.prefix.rstrip("/")
            expected[name], measured[name] = scale.report.scale, norm / token_mean
    return expected, measured


def _layout_outcome(name: str, run_layout, parts: list[Part], ctx: Context, ref_grads: dict,
                    session: CheckSession) -> Outcome:
    """Run one layout for every model; its loss, gradient norm and difference, and finalised comparable metrics;
    or, when it raises, an outcome that is one FAIL row naming the exception."""
    try:
        return _run_layout(name, run_layout, parts, ctx, ref_grads, session)
    except Exception as error:  # a crashing layout is a failure of that layout, the others still run
        for part in parts:  # on a clean FSDP state: a backward that raised midway leaves it mid-iteration
            reset_after_error(part.model)
        return Outcome(name, {}, covers=(), error=describe_error(error))


def _run_layout(name: str, run_layout, parts: list[Part], ctx: Context, ref_grads: dict,
                session: CheckSession) -> Outcome:
    values, kinds = {}, {}
    for part in parts:
        result = run_layout(part, ctx)
        values[part.prefix + "loss"] = result.loss
        values[part.prefix + "grad_max_diff"] = grad_max_diff(result.grads, ref_grads[part.prefix])
        max_norm = CLIP_PROBE * grad_norm(ref_grads[part.prefix])
        values[part.prefix + "grad_norm"], values[part.prefix + "clip_coef"] = trainer_clip(part, result.grads,
                                                                                            max_norm)
        values.update({part.prefix + k: v for k, v in result.values().items()})
        kinds.update({part.prefix + k: v for k, v in comparable(result.metrics).items()})
    covers = ("actor/", "critic/", DRAFTER)
    if run_layout is real_ranks:  # the step's rollout metrics, reduced over the real ranks
        rollout = session.trainer.rollout_metrics(session.batch.rollouts)
        values.update(finalize(rollout))
        kinds.update(comparable(rollout))
        covers += ROLLOUT_PREFIXES
    return Outcome(name, values, kinds, covers)


def _notes(parts: list[Part], reference: Outcome, on_policy: bool) -> list[str]:
    """What this batch cannot prove, said out loud."""
    notes = []
    if len(parts) > 1 and EV_NAME not in reference.values:
        notes.append(f"{EV_NAME} is undefined on this batch (the returns have no variance): not compared")
    for part in parts:
        if reference.values[part.prefix + "grad_norm"] == 0.0:
            notes.append(f"the {part.prefix.rstrip('/')} gradient is zero on this batch (every advantage is 0?): its "
                         "gradient comparisons prove nothing; raise check.num_prompts or change data.seed")
    if not on_policy:
        notes.append("the rollouts carry behaviour log-probs: the on-policy check (ratio 1, clip fraction 0) is "
                     "skipped")
    return notes


IS_DIFF = "experience/is_weights_max_diff"
UPDATE = "update/"


def _correction_outcome(batch: CheckBatch) -> tuple[dict[str, float], Outcome, dict[str, float]]:
    """The rollout-correction weights and ``experience/rollout_is_*`` (and ``experience/rollout_rs_*`` of rejection
    sampling) that the product made for the batch (in ``make_targets``, metrics reduced over the ranks as the step
    logs them) against :func:`reference_is_weights`, :func:`reference_is_metrics` and :func:`rejection_metrics` from
    the definitions: the reference's values, the product's outcome, the scales."""
    want = rejection_metrics(batch) if batch.rejection is not None else {}
    if batch.correction is None:
        mine = {k: v for k, v in batch.experience.items() if k.startswith("experience/")}  # rollout_corr/*: own stage
        return want, Outcome("experience", mine, covers=("experience/",)), {}
    olds, behaviours, policy_masks = [t.old_logprobs for t in batch.full.targets], batch.behaviour, \
        batch.policy_token_masks()
    want.update(reference_is_metrics(olds, behaviours, batch.correction, policy_masks))
    worst, largest = 0.0, 0.0
    for old, behaviour, target, policy in zip(olds, behaviours, batch.full.targets, policy_masks):
        if any(policy):
            weights, _ = reference_is_weights(old, behaviour, batch.correction, policy)
            got = target.is_weights.double()[torch.tensor(policy, dtype=torch.bool)]
            worst = worst_of(worst, float((got - weights).abs().max()))
            largest = max(largest, float(weights.abs().max()))
    want[IS_DIFF] = 0.0
    got = {**{k: v for k, v in batch.experience.items() if k.startswith("experience/")}, IS_DIFF: worst}
    return want, Outcome("experience", got, covers=("experience/",)), {IS_DIFF: largest}


def rejection_metrics(batch: CheckBatch) -> dict[str, float]:
    """``experience/rollout_rs_*`` from the reference's own masks: the share of the policy's tokens it does not count,
    and the share of sequences with a policy token left with none; and the mean ratio the tokens were judged by
    (:func:`reference_rejection_ratio_mean`) and the mean divergence statistic (:func:`reference_divergences`), of
    the rejections that are on."""
    policy, counted, rejection = batch.policy_token_masks(), batch.counted_masks(), batch.rejection
    num_policy = sum(sum(p) for p in policy)
    seqs = [(p, c) for p, c in zip(policy, counted) if any(p)]
    want = {"experience/rollout_rs_rejected_token_frac": (num_policy - sum(sum(c) for c in counted)) / num_policy,
            "experience/rollout_rs_rejected_seq_frac": sum(1 for _, c in seqs if not any(c)) / len(seqs)}
    if rejection.level != "none":
        want["experience/rollout_rs_ratio_mean"] = reference_rejection_ratio_mean(batch.trainer_old, batch.behaviour,
                                                                                  policy, rejection.level)
    if rejection.divergence != "none":
        stats = [k for old, behaviour, mask in zip(batch.trainer_old, batch.behaviour, policy)
                 for k in reference_divergences([o - b for o, b, m in zip(old.double().tolist(),
                                                                          behaviour.double().tolist(), mask) if m],
                                                rejection.divergence)]
        want["experience/rollout_rs_divergence_mean"] = sum(stats) / len(stats)
    return want


def _context(session: CheckSession, batch, counts: Counts) -> Context:
    cfg, tr = session.cfg, session.trainer
    coef = tr.models.policy_part.moe_coef
    moe = None if coef is None else reference_moe_norms(tr.models.policy, batch.full, coef)
    return Context(full=batch.full, local=batch.local,
                   norms=LossNormalizers(counts.num_tokens, counts.num_seqs, dp_size=1,
                                         loss_scale_factor=tr.loss_scale_factor, moe=moe),
                   token_budget=cfg.trainer.token_budget, simulated_dp=max(2, cfg.check.simulated_dp), mesh=tr.mesh,
                   device=tr.device)


def _shares_prompts(cfg, trainer) -> bool:
    """``trainer.share_prompts`` of the checked config, resolved as training resolves it (auto: on where the backend,
    the model and the features allow): the shared-prompt layouts run when training would share prompts."""
    return resolve_share_prompts(cfg, trainer.models.backend, trainer.models.policy.config)[0]


def _off_policy(session: CheckSession, plan: Plan) -> tuple[Outcome, list[Comparison], list[Check]]:
    """The off-policy pass (:mod:`fsdptrain.check.passes`): its layouts (``plan.off_planned``) on the perturbed batch
    with the off-policy paths on; names carry the ``off-policy/`` prefix."""
    cfg, tr, mode, tol, progress = session.cfg, session.trainer, plan.mode, plan.tol, plan.progress
    alg = cfg.algorithm
    correction = alg.rollout_correction if alg.rollout_correction != "none" else "tis"
    level = alg.rollout_correction_level if alg.rollout_correction != "none" else "token"
    off_batch = off_policy_batch(session.batch, correction=correction, level=level, cap=alg.rollout_correction_cap,
                                 low=alg.rollout_correction_low)
    off = dataclasses.replace(session, batch=off_batch)
    parts = [dataclasses.replace(p, settings=off_policy_settings(p.settings) if p.prefix == "actor/" else
                                 off_policy_value_settings(p.settings))
             for p in checked_policy_and_critic(parts_of(session, mode))]
    counts = Counts.of(off_batch.counted_masks(), tr.loss_scale_factor)
    ctx = _context(off, off_batch, counts)
    reference, scales, ref_grads = progress.run("off-policy: reference", lambda: _reference(off, parts, counts))
    outcomes = [progress.run("off-policy: " + name,
                             lambda: _layout_outcome(name, run_layout, parts, ctx, ref_grads, off))
                for name, run_layout in plan.off_planned]
    reference = _prefixed(reference, keep_rollout=False)
    outcomes = [_prefixed(o, keep_rollout=False) for o in outcomes]
    scales = {OFF + k: v for k, v in scales.items()}
    skip = frozenset() if OFF + EV_NAME in reference.values else frozenset({OFF + EV_NAME})
    comparisons = [c for o in outcomes for c in compare(reference, o, scales=scales, skip=skip, **tol)]
    checks = [k for o in (reference, *outcomes) for k in self_checks(o, on_policy=False, **tol)]
    return reference, comparisons, checks


def _prefixed(outcome: Outcome, *, keep_rollout: bool) -> Outcome:
    values = {OFF + k: v for k, v in outcome.values.items() if keep_rollout or k.startswith(("actor/", "critic/"))}
    kinds = {OFF + k: v for k, v in outcome.kinds.items() if OFF + k in values}
    covers = tuple(OFF + c for c in outcome.covers if c in ("actor/", "critic/"))
    return Outcome("off-policy: " + outcome.layout if outcome.layout != "reference" else "reference", values, kinds,
                   covers, error=outcome.error)


def _drafter_pass(session: CheckSession, plan: Plan) -> tuple[Outcome, list[Comparison]]:
    """The drafter's reference and layouts (:mod:`fsdptrain.check.draft_check`), run after every policy and critic
    row. Gradients are zeroed with `zero_grads`: the oracle's no-grad teacher forwards leave the policy's root unit
    unsharded, and a plain `zero_grad` then missed its sharded gradients (docs/check-metrics.md)."""
    parts, ctx, progress = plan.every_part[len(plan.parts):], plan.ctx, plan.progress
    full, scales, ref_grads = progress.run("drafter: reference", lambda: _reference(session, parts, plan.counts))
    reference = Outcome("reference", {k: v for k, v in full.values.items() if k.startswith(DRAFTER)}, covers=())
    comparisons = []
    for name, run_layout in plan.planned:
        outcome = progress.run("drafter: " + name,
                               lambda: _layout_outcome(name, run_layout, parts, ctx, ref_grads, session))
        mine = {k: v for k, v in outcome.values.items() if k.startswith(DRAFTER)}
        drafter = Outcome(name, mine, {k: v for k, v in outcome.kinds.items() if k in mine}, covers=(DRAFTER,),
                          error=outcome.error)
        comparisons += compare(reference, drafter, scales=scales, **plan.tol)
    return reference, comparisons


@dataclass
class Found:
    """What the stages of :func:`run_checks` found so far: reference values, comparisons, checks and notes."""

    reference: Outcome
    comparisons: list[Comparison] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def stage(self, name: str, run, progress: Optional[Progress] = None) -> None:
        """Run one stage (one progress line when ``progress`` is given: a stage that counts its own passes gives
        none); an exception it raises becomes one FAIL row named after it (docs/check-metrics.md)."""
        try:
            run() if progress is None else progress.run(name, run)
        except Exception as error:  # a bug that crashes a path is reported like one that miscounts
            self.comparisons.append(raised(f"({name} raised)", name, error))


def _correction_stage(found: Found, batch: CheckBatch, tol: dict) -> None:
    """The rollout-correction weights, the rejection and their metrics against the reference's
    (:func:`_correction_outcome`)."""
    want, got, is_scales = _correction_outcome(batch)
    found.reference.values.update(want)
    found.comparisons += compare(found.reference, got, scales=is_scales, **tol)
    if batch.planted_behaviour:
        found.notes.append("the rollouts carry no behaviour log-probs: the check gave them old + U(-1, 1) (seeded), "
                           + ("so the importance weights are not all 1; the old log-probs stay the policy's own"
                              if batch.correction is not None else
                              "so rejection sampling has ratios to reject; without a correction they are the old "
                              "log-probs (the batch is off-policy)"))


OFF_POLICY = "rollout_corr/"


def _off_policy_diagnostics_stage(found: Found, session: CheckSession, tol: dict) -> None:
    """``rollout_corr/*`` as the step logged them (made in ``make_targets`` from the packed old log-prob pass, reduced
    over the ranks) against :func:`reference_off_policy_metrics` with old log-probs from the one-sequence-at-a-time
    reference forward (collective: every rank runs the same forwards)."""
    batch, trainer = session.batch, session.trainer
    real = range(len(batch.scores))
    with torch.no_grad():
        olds = [reference_policy_outputs(trainer.models.policy, batch.full.prompts[i], batch.full.responses[i],
                                         temperature=trainer.experience_settings.temperature)[0].cpu()
                if batch.carried_behaviour[i] is not None and batch.full.responses[i] else torch.zeros(0)
                for i in real]
    want = reference_off_policy_metrics(olds, [batch.carried_behaviour[i] for i in real],
                                        [batch.policy_masks[i] for i in real])
    found.reference.values.update(want)
    got = {k: v for k, v in batch.experience.items() if k.startswith(OFF_POLICY)}
    found.comparisons += compare(found.reference, Outcome("experience", got, covers=(OFF_POLICY,)), scales={},
                                 **tol)


def _update_stage(found: Found, session: CheckSession, tol: dict) -> None:
    """The update pass (:mod:`fsdptrain.check.update_pass`); its rows carry the ``update/`` prefix."""
    want, got, scales = update_pass(session, session.update)
    prefixed = Outcome(got.layout, {UPDATE + k: v for k, v in got.values.items()},
                       {UPDATE + k: v for k, v in got.kinds.items()}, covers=(UPDATE,))
    want = {UPDATE + k: v for k, v in want.items()}
    found.reference.values.update(want)
    found.comparisons += compare(Outcome("reference", want, covers=()), prefixed,
                                 scales={UPDATE + k: v for k, v in scales.items()}, **tol)
    if not session.update.configured:
        found.notes.append(f"the update pass ran {session.update.layout} (you configured 1 and 1)")


@dataclass
class Plan:
    """What one :func:`run_checks` runs: the loss mode, the models (``parts``: policy and critic; ``every_part``:
    the drafter too), the batch's counts and context, the layouts of the configured and of the off-policy pass, the
    tolerances, which later stages run, and the progress lines."""

    mode: str
    every_part: list[Part]
    parts: list[Part]
    counts: Counts
    ctx: Context
    planned: list
    off_planned: list
    tol: dict
    experience: bool
    update: bool
    progress: Optional[Progress] = None

    @property
    def has_drafter(self) -> bool:
        return len(self.every_part) > len(self.parts)

    def num_passes(self, batch: CheckBatch) -> int:
        """The progress lines: the reference and each layout of each pass, the gradient scale, each stage."""
        per_pass = 1 + len(self.planned)
        return (per_pass + 1 + (1 + len(self.off_planned) if self.off_planned else 0) + self.has_drafter * per_pass
                + self.update + self.experience + (batch.correction is not None or batch.rejection is not None)
                + (batch.carried_behaviour is not None))


def _plan(session: CheckSession, mode: str, *, off_policy: bool, experience: bool, update: bool) -> Plan:
    cfg, batch, tr = session.cfg, session.batch, session.trainer
    every_part = parts_of(session, mode)
    counts = Counts.of(batch.counted_masks(), tr.loss_scale_factor)
    ctx = _context(session, batch, counts)
    common = dict(token_budget=ctx.token_budget, simulated_dp_size=ctx.simulated_dp, world_size=session.world_size,
                  cp=cfg.parallel.cp)
    plan = Plan(mode, every_part, checked_policy_and_critic(every_part), counts, ctx,
                layouts(batch.full, share_prompts=_shares_prompts(cfg, tr), **common),
                layouts(batch.full, off_policy=True, **common) if off_policy else [],
                dict(rtol=cfg.check.rtol, atol=cfg.check.atol), experience,
                update and session.update is not None and mode == cfg.loss.agg_mode)
    plan.progress = Progress(plan.num_passes(batch))
    return plan


def run_checks(session: CheckSession, agg_mode: Optional[str] = None, *, off_policy: bool = True,
               experience: bool = True, update: bool = True) -> CheckReport:
    """Reference, every layout and the comparisons for ``agg_mode`` (default: the configured one), then the
    off-policy pass, the rollout-correction weights, the experience checks, the update over several mini-batches and
    epochs (the configured mode only) and the drafter (docs/check-metrics.md), in the checked precision
    (:mod:`fsdptrain.check.precision`). Each stage, and each layout within one, that raises is a FAIL row; the
    others still run. Collective."""
    plan = _plan(session, agg_mode or session.cfg.loss.agg_mode, off_policy=off_policy, experience=experience,
                 update=update)
    found = Found(Outcome("reference", {}, covers=()))
    grad_scale = GradScale(_scale_report(session, plan.mode, plan.counts))
    with checked_precision(session.cfg):
        found.stage("configured", lambda: _configured(found, session, plan, grad_scale))
        _later_stages(found, session, plan)
    found.notes += session.notes
    names = [name for name, _ in plan.planned] + ["off-policy: " + name for name, _ in plan.off_planned]
    if plan.update:
        names.append(session.update.layout)
    return CheckReport(plan.mode, names, found.reference, found.comparisons, found.checks, grad_scale, found.notes)


def _configured(found: Found, session: CheckSession, plan: Plan, grad_scale: GradScale) -> None:
    """The reference, every configured layout and the gradient-scale row, compared; the self-checks and notes."""
    batch, parts, ctx, progress, tol = session.batch, plan.parts, plan.ctx, plan.progress, plan.tol
    reference, scales, ref_grads = progress.run("reference", lambda: _reference(session, parts, plan.counts))
    found.reference.values.update(reference.values)
    outcomes = [progress.run(name, lambda: _layout_outcome(name, run_layout, parts, ctx, ref_grads, session))
                for name, run_layout in plan.planned]
    expected, measured = progress.run("token-mean (gradient scale)",
                                      lambda: _grad_scale(grad_scale, parts, ctx, plan.mode, reference))
    found.reference.values.update(expected)
    if measured:
        outcomes.append(Outcome("token-mean, same batch", measured, covers=("grad_scale/",)))
    skip = frozenset() if EV_NAME in reference.values else frozenset({EV_NAME})
    found.comparisons += [c for o in outcomes for c in compare(found.reference, o, scales=scales, skip=skip, **tol)]
    found.checks += [k for o in (found.reference, *outcomes) for k in self_checks(o, on_policy=batch.on_policy, **tol)]
    found.notes += _notes(parts, reference, batch.on_policy)


def _later_stages(found: Found, session: CheckSession, plan: Plan) -> None:
    """The stages after the configured layouts: the off-policy pass, the rollout-correction weights, the off-policy
    diagnostics, the experience checks, the update pass and the drafter (each that applies)."""
    batch, tol, progress = session.batch, plan.tol, plan.progress
    if plan.off_planned:
        def off() -> None:
            off_reference, off_comparisons, off_checks = _off_policy(session, plan)
            found.reference.values.update(off_reference.values)
            found.comparisons += off_comparisons
            found.checks += off_checks

        found.stage("off-policy", off)
    if batch.correction is not None or batch.rejection is not None:
        found.stage("rollout-correction weights", lambda: _correction_stage(found, batch, tol), progress)
    if batch.carried_behaviour is not None:
        found.stage("off-policy diagnostics", lambda: _off_policy_diagnostics_stage(found, session, tol), progress)
    if plan.experience:
        def experience_stage() -> None:
            experience_found, note = experience_checks(session, **tol)
            found.checks += batch.raw_checks + experience_found  # the reference's own cut and rewards first
            found.notes += batch.raw_notes + ([note] if note else [])

        found.stage("experience", experience_stage, progress)
    if plan.update:
        found.stage("update", lambda: _update_stage(found, session, tol), progress)
    if plan.has_drafter:
        def drafter() -> None:
            drafter_reference, drafter_comparisons = _drafter_pass(session, plan)
            found.reference.values.update(drafter_reference.values)
            found.comparisons += drafter_comparisons

        found.stage("drafter", drafter)


def check_metrics(cfg: DictConfig, *, json_path: Optional[str] = None) -> int:
    """The ``fsdptrain check-metrics`` job on this rank; returns the exit code (the same on every rank)."""
    if cfg.data.source == "sft":  # an fsdptrain sft config: its own layouts and reference
        from fsdptrain.check.sft_check import check_sft_metrics

        return check_sft_metrics(cfg, json_path=json_path)
    info = world.init_distributed(device_type=resolve_device_type(cfg))
    replicate, shard = validate_world(cfg, info.world_size)
    mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type=info.device.type, cp=cfg.parallel.cp)
    session = build_session(cfg, info, mesh)
    report = run_checks(session)
    written = True
    if info.is_main:
        print_report(report, session)
        written = write_report_json(report, json_path)
    # Also a barrier: a rank leaving early with 1 makes the launcher stop rank 0 in the middle of its report.
    code = exit_code(failed=world.agree_max_int(0 if report.ok else 1) > 0,
                     unwritten=world.agree_max_int(0 if written else 1) > 0)
    world.destroy_distributed()
    return code

