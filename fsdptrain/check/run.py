"""``fsdptrain check-metrics``: the same mini-batch in many layouts, compared with a one-sequence-at-a-time reference.

On every rank: build the models and one mini-batch of experience as ``fsdptrain train`` does
(:mod:`fsdptrain.check.batch`), run the reference (:mod:`fsdptrain.check.reference`) and every layout
(:mod:`fsdptrain.check.layouts`) forward and backward with no optimiser step, for the policy and the critic, and
compare the loss, the gradient (global norm, largest entry difference) and every non-DIAGNOSTIC metric
(:mod:`fsdptrain.check.compare`). Rank 0 prints the table, the gradient-scale report and the failures, and writes
``--json``. Exit code 0 when everything passes, 1 when anything fails (docs/check-metrics.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from fsdptrain.check.batch import CheckSession, build_session
from fsdptrain.check.compare import (
    Check,
    Comparison,
    Outcome,
    compare,
    failure_lines,
    rows,
    self_checks,
    to_json,
)
from fsdptrain.check.draft_check import PREFIX as DRAFTER
from fsdptrain.check.draft_check import (
    draft_part_settings,
    packed_draft_part_loss,
    per_sequence_draft_part_loss,
    reference_drafter,
)
from fsdptrain.check.layouts import (
    Context,
    Part,
    grad_max_abs,
    grad_max_diff,
    grad_norm,
    layouts,
    padded_policy_loss,
    padded_value_loss,
    real_ranks,
    token_mean_grad_norm,
)
from fsdptrain.check.oracles import per_sequence_policy_loss, per_sequence_value_loss
from fsdptrain.check.passes import (
    experience_checks,
    off_policy_batch,
    off_policy_settings,
    off_policy_value_settings,
)
from fsdptrain.check.reference import Counts, reference_critic, reference_policy, reference_rollout_metrics
from fsdptrain.config import validate_world
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import gather_full_grads, zero_grads
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.grad_scale import GradScaleReport, grad_scale_report
from fsdptrain.rl.metrics import comparable, finalize
from fsdptrain.train.build import resolve_device_type
from fsdptrain.train.step import packed_policy_loss, packed_value_loss

ROLLOUT_PREFIXES = ("reward/", "response_length/", "batch/")
EV_NAME = "critic/vf_explained_var"


@dataclass
class GradScale:
    """The configured mode's report and, per model, the measured gradient norms under it and under token-mean."""

    report: GradScaleReport
    measured: dict[str, tuple[float, float]] = field(default_factory=dict)  # prefix -> (mode's norm, token-mean's)


@dataclass
class CheckReport:
    mode: str
    layouts: list[str]
    reference: Outcome
    comparisons: list[Comparison]
    checks: list[Check]
    grad_scale: GradScale
    notes: list[str]

    @property
    def failures(self) -> list[str]:
        return failure_lines(self.comparisons, self.checks)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        gs = self.grad_scale
        return {
            "ok": self.ok, "agg_mode": self.mode, "layouts_run": self.layouts, "notes": self.notes,
            "reference": self.reference.values, **to_json(self.comparisons, self.checks),
            "grad_scale": {"expected_scale": gs.report.scale, "description": gs.report.describe(),
                           "measured": {p: {"grad_norm": a, "token_mean_grad_norm": b}
                                        for p, (a, b) in gs.measured.items()}},
            "failures": self.failures,
        }


def parts_of(session: CheckSession, mode: str) -> list[Part]:
    """The policy and, when the algorithm has one, the critic, with the loss settings for ``mode``."""
    tr = session.trainer
    out = [Part("actor/", tr.models.policy, replace(tr.policy_settings, agg_mode=mode), packed_policy_loss,
                per_sequence_policy_loss, padded_policy_loss)]
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
                                                              counts.loss_scale_factor)
            values.update(metrics, **{DRAFTER + "grad_norm": grad_norm(grads[DRAFTER]), DRAFTER + "grad_max_diff": 0.0})
            scales[DRAFTER + "grad_max_diff"] = grad_max_abs(grads[DRAFTER])
            continue
        run = reference_policy if part.prefix == "actor/" else reference_critic
        loss, metrics, loss_scales = run(part.model, session.batch.full, part.settings, counts)
        scales.update({part.prefix + k: v for k, v in loss_scales.items()})
        grads[part.prefix] = gather_full_grads(part.model)
        values[part.prefix + "loss"] = loss
        values[part.prefix + "grad_norm"] = grad_norm(grads[part.prefix])
        values[part.prefix + "grad_max_diff"] = 0.0
        scales[part.prefix + "grad_max_diff"] = grad_max_abs(grads[part.prefix])
        values.update({part.prefix + k: v for k, v in metrics.items()})
    values.update(reference_rollout_metrics(session.batch.facts))
    return Outcome("reference", values, covers=()), scales, grads


def _grad_scale(session: CheckSession, parts: list[Part], ctx: Context, mode: str, reference: Outcome,
                counts: Counts) -> tuple[GradScale, dict[str, float], dict[str, float]]:
    """The report for ``mode`` on this batch, and per model the expected and the measured ratio of the gradient norm
    to token-mean's (absent for seq-mean-token-mean, which reweights instead of scaling, or a zero gradient)."""
    report = grad_scale_report(mode, num_tokens=counts.num_tokens, num_seqs=counts.num_seqs,
                               seq_lengths=[len(r) for r in session.batch.full.responses],
                               dp_size=session.world_size, loss_scale_factor=counts.loss_scale_factor,
                               grad_clip=session.cfg.trainer.grad_clip)
    scale = GradScale(report)
    expected, measured = {}, {}
    for part in parts:
        norm = reference.values[part.prefix + "grad_norm"]
        token_mean = norm if mode == "token-mean" else token_mean_grad_norm(part, ctx)
        scale.measured[part.prefix] = (norm, token_mean)
        if report.scale is not None and token_mean > 0:
            name = "grad_scale/" + part.prefix.rstrip("/")
            expected[name], measured[name] = report.scale, norm / token_mean
    return scale, expected, measured


def _layout_outcome(name: str, run_layout, parts: list[Part], ctx: Context, ref_grads: dict,
                    session: CheckSession) -> Outcome:
    """Run one layout for every model; its loss, gradient norm and difference, and finalised comparable metrics."""
    values, kinds = {}, {}
    for part in parts:
        result = run_layout(part, ctx)
        values[part.prefix + "loss"] = result.loss
        values[part.prefix + "grad_norm"] = grad_norm(result.grads)
        values[part.prefix + "grad_max_diff"] = grad_max_diff(result.grads, ref_grads[part.prefix])
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


OFF = "off-policy/"


def _context(session: CheckSession, batch, counts: Counts) -> Context:
    cfg, tr = session.cfg, session.trainer
    return Context(full=batch.full, local=batch.local,
                   norms=LossNormalizers(counts.num_tokens, counts.num_seqs, dp_size=1,
                                         loss_scale_factor=tr.loss_scale_factor),
                   token_budget=cfg.trainer.token_budget, simulated_dp=max(2, cfg.check.simulated_dp), mesh=tr.mesh,
                   device=tr.device)


def _off_policy(session: CheckSession, mode: str, tol: dict) -> tuple[Outcome, list[Comparison], list[Check]]:
    """The off-policy pass (:mod:`fsdptrain.check.passes`): every layout on the perturbed batch with the off-policy
    paths on; names carry the ``off-policy/`` prefix."""
    cfg, tr = session.cfg, session.trainer
    alg = cfg.algorithm
    correction = alg.rollout_correction if alg.rollout_correction != "none" else "tis"
    level = alg.rollout_correction_level if alg.rollout_correction != "none" else "token"
    off_batch = off_policy_batch(session.batch, correction=correction, level=level, cap=alg.rollout_correction_cap)
    off = dataclasses.replace(session, batch=off_batch)
    parts = [dataclasses.replace(p, settings=off_policy_settings(p.settings) if p.prefix == "actor/" else
                                 off_policy_value_settings(p.settings))
             for p in checked_policy_and_critic(parts_of(session, mode))]
    counts = Counts.of(off_batch.full, tr.loss_scale_factor)
    ctx = _context(off, off_batch, counts)
    reference, scales, ref_grads = _reference(off, parts, counts)
    planned = layouts(off_batch.full, token_budget=ctx.token_budget, simulated_dp_size=ctx.simulated_dp,
                      world_size=off.world_size)
    outcomes = [_layout_outcome(name, run_layout, parts, ctx, ref_grads, off) for name, run_layout in planned]
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
                   covers)


def _drafter_pass(session: CheckSession, parts: list[Part], ctx: Context, planned, counts: Counts,
                  tol: dict) -> tuple[Outcome, list[Comparison]]:
    """The drafter's reference and layouts (:mod:`fsdptrain.check.draft_check`), run after every policy and critic
    row. Gradients are zeroed with `zero_grads`: the oracle's no-grad teacher forwards leave the policy's root unit
    unsharded, and a plain `zero_grad` then missed its sharded gradients (docs/check-metrics.md)."""
    full, scales, ref_grads = _reference(session, parts, counts)
    reference = Outcome("reference", {k: v for k, v in full.values.items() if k.startswith(DRAFTER)}, covers=())
    comparisons = []
    for name, run_layout in planned:
        outcome = _layout_outcome(name, run_layout, parts, ctx, ref_grads, session)
        mine = {k: v for k, v in outcome.values.items() if k.startswith(DRAFTER)}
        drafter = Outcome(name, mine, {k: v for k, v in outcome.kinds.items() if k in mine}, covers=(DRAFTER,))
        comparisons += compare(reference, drafter, scales=scales, **tol)
    return reference, comparisons


def run_checks(session: CheckSession, agg_mode: Optional[str] = None, *, off_policy: bool = True,
               experience: bool = True) -> CheckReport:
    """Reference, every layout and the comparisons for ``agg_mode`` (default: the configured one), then the
    off-policy pass and the experience checks (docs/check-metrics.md). Collective."""
    cfg, batch, tr = session.cfg, session.batch, session.trainer
    mode = agg_mode or cfg.loss.agg_mode
    every_part = parts_of(session, mode)
    parts = checked_policy_and_critic(every_part)
    counts = Counts.of(batch.full, tr.loss_scale_factor)
    ctx = _context(session, batch, counts)
    reference, scales, ref_grads = _reference(session, parts, counts)
    planned = layouts(batch.full, token_budget=ctx.token_budget, simulated_dp_size=ctx.simulated_dp,
                      world_size=session.world_size)
    outcomes = [_layout_outcome(name, run_layout, parts, ctx, ref_grads, session) for name, run_layout in planned]
    grad_scale, expected, measured = _grad_scale(session, parts, ctx, mode, reference, counts)
    reference.values.update(expected)
    if measured:
        outcomes.append(Outcome("token-mean, same batch", measured, covers=("grad_scale/",)))
    skip = frozenset() if EV_NAME in reference.values else frozenset({EV_NAME})
    tol = dict(rtol=cfg.check.rtol, atol=cfg.check.atol)
    comparisons = [c for o in outcomes for c in compare(reference, o, scales=scales, skip=skip, **tol)]
    checks = [k for o in (reference, *outcomes) for k in self_checks(o, on_policy=batch.on_policy, **tol)]
    notes = _notes(parts, reference, batch.on_policy)
    names = [name for name, _ in planned]
    if off_policy:
        off_reference, off_comparisons, off_checks = _off_policy(session, mode, tol)
        reference.values.update(off_reference.values)
        comparisons += off_comparisons
        checks += off_checks
        names += ["off-policy: " + name for name in names]
    if experience:
        experience_found, note = experience_checks(session, **tol)
        checks += experience_found
        notes += [note] if note else []
    if len(every_part) > len(parts):
        drafter_reference, drafter_comparisons = _drafter_pass(session, every_part[len(parts):], ctx, planned, counts,
                                                               tol)
        reference.values.update(drafter_reference.values)
        comparisons += drafter_comparisons
    return CheckReport(mode, names, reference, comparisons, checks, grad_scale, notes)


# ---- output -------------------------------------------------------------------------------------------------------


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.6g}"


def print_report(report: CheckReport, session: CheckSession, file=None) -> None:
    """The table, the self-checks, the gradient-scale report and the verdict (rank 0)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=160)
    cfg, batch = session.cfg, session.batch
    num_real = batch.full.num_seqs - int(batch.has_fixture)
    console.print(
        f"check-metrics: {cfg.algorithm.name}, loss.agg_mode={report.mode}, {num_real} sequences "
        f"({sum(len(r) for r in batch.full.responses)} response tokens) from {cfg.rollout.prompts_per_step} prompt "
        f"group(s) on {session.world_size} rank(s); rtol={cfg.check.rtol:g}, atol={cfg.check.atol:g}")
    fixtures = []
    if batch.has_fixture:
        fixtures.append("+1 prompt-only sequence (no response token)")
    if batch.value_shift is not None:
        fixtures.append(f"critic outputs shifted by {batch.value_shift:.4g} (every value < 0)")
    if fixtures:
        console.print("fixtures: " + "; ".join(fixtures))
    console.print("layouts: " + ", ".join(report.layouts) + ", token-mean (gradient scale)")
    table = Table(title=f"check-metrics: every layout against the reference ({report.mode})")
    for column, justify in (("metric", "left"), ("reference", "right"), ("worst layout", "left"),
                            ("max |diff|", "right"), ("max rel diff", "right"), ("result", "center")):
        table.add_column(column, justify=justify)
    for row in rows(report.comparisons, report.reference):
        result = "[green]PASS[/green]" if row.passed else "[bold red]FAIL[/bold red]"
        table.add_row(row.metric, _fmt(row.reference), row.worst.layout, _fmt(row.worst.abs_diff),
                      _fmt(row.worst.rel_diff), result)
    console.print(table)
    failed_checks = [k for k in report.checks if not k.passed]
    console.print(f"self-consistency and on-policy checks: {len(report.checks) - len(failed_checks)} of "
                  f"{len(report.checks)} pass (min <= mean <= max, fractions in [0, 1], counts whole"
                  f"{', ratio 1 and clip fraction 0 on this first mini-batch' if batch.on_policy else ''})")
    console.print("normalisation: " + report.grad_scale.report.describe(), highlight=False)
    for prefix, (norm, token_mean) in report.grad_scale.measured.items():
        line = f"measured {prefix.rstrip('/')} gradient norm: {norm:.6g} under {report.mode}"
        if report.mode != "token-mean":
            ratio = f"{norm / token_mean:.6g}x" if token_mean > 0 else "ratio undefined"
            line += f", {token_mean:.6g} under token-mean on the same batch ({ratio} token-mean's)"
        console.print(line, highlight=False)
    bite = [(name, report.reference.values.get(OFF + name)) for name in
            ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/kl", "critic/vf_clipfrac")]
    if any(v is not None for _, v in bite):
        console.print("off-policy pass (perturbed old/ref log-probs and values, importance weights, temperature "
                      f"{off_policy_settings(session.trainer.policy_settings).temperature:g}): "
                      + ", ".join(f"{n} {v:.3g}" for n, v in bite if v is not None)
                      + " on the reference: the clip, dual-clip and KL paths bit on these shares", highlight=False)
    for note in report.notes:
        console.print("note: " + note, highlight=False)
    failures = report.failures
    for line in failures:
        console.print(line, style="red", highlight=False, markup=False)
    if failures:
        console.print(f"check-metrics: FAIL ({len(failures)} failure(s))", style="bold red")
    else:
        console.print(f"check-metrics: PASS ({len(report.comparisons)} comparisons, {len(report.checks)} checks)",
                      style="bold green")


def check_metrics(cfg: DictConfig, *, json_path: Optional[str] = None) -> int:
    """The ``fsdptrain check-metrics`` job on this rank; returns the exit code (the same on every rank)."""
    info = world.init_distributed(device_type=resolve_device_type(cfg))
    replicate, shard = validate_world(cfg, info.world_size)
    mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type=info.device.type)
    session = build_session(cfg, info, mesh)
    report = run_checks(session)
    if info.is_main:
        print_report(report, session)
        if json_path is not None:
            Path(json_path).write_text(json.dumps(report.to_json(), indent=1) + "\n")
            print(f"wrote {json_path}", flush=True)
    # Also a barrier: a rank leaving early with 1 makes the launcher stop rank 0 in the middle of its report.
    code = world.agree_max_int(0 if report.ok else 1)
    world.destroy_distributed()
    return code

