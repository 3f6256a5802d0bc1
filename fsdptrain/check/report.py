"""check-metrics, part 8: the report. The table of every metric's worst layout, the self-checks, the gradient-scale
report, the notes and the verdict (rank 0), and the ``--json`` shape (docs/check-metrics-output.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from fsdptrain.check.batch import CheckSession
from fsdptrain.check.compare import Check, Comparison, MetricRow, Outcome, failure_lines, rows, to_json
from fsdptrain.check.passes import off_policy_settings
from fsdptrain.distributed.rank_errors import report_failure
from fsdptrain.registry.errors import OUTPUT_NOT_WRITTEN_EXIT, OutputNotWritten
from fsdptrain.rl.grad_scale import GradScaleReport

OFF = "off-policy/"

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

def write_report_json(report: CheckReport, json_path: Optional[str]) -> bool:
    """``--json``: every result of the report (rank 0), when asked for. False when the file could not be written (a
    full disk, say): the one ``error:`` line names ``--json`` and the path, and the command's exit code is
    :data:`OUTPUT_NOT_WRITTEN_EXIT`, never a failed comparison's 1 (:func:`exit_code`)."""
    if json_path is None:
        return True
    import json
    from pathlib import Path

    try:
        Path(json_path).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    except OSError as err:
        report_failure(f"error: {OutputNotWritten('--json', json_path, err)}", rank=0)
        return False
    print(f"wrote {json_path}", flush=True)
    return True


def exit_code(*, failed: bool, unwritten: bool) -> int:
    """check-metrics' exit code, agreed by every rank: 1 when a comparison failed, else
    :data:`OUTPUT_NOT_WRITTEN_EXIT` when ``--json`` could not be written, else 0."""
    return 1 if failed else OUTPUT_NOT_WRITTEN_EXIT if unwritten else 0


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.6g}"


def _short(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


COLUMNS = (("metric", "left"), ("reference", "right"), ("worst layout", "left"), ("max |diff|", "right"),
           ("max rel diff", "right"), ("tolerance", "right"), ("|diff|/tol", "right"), ("result", "center"))
"""The table's columns: the worst layout's |diff| over its tolerance says how far from failing a row was (above 1
fails)."""


def add_columns(table) -> None:
    for column, justify in COLUMNS:
        table.add_column(column, justify=justify)


def row_cells(row: MetricRow) -> tuple[str, ...]:
    """One table row: the metric, its reference, the worst layout, the largest differences over every layout, the
    worst layout's tolerance and |diff|/tolerance, and the verdict."""
    worst = row.worst
    margin = worst.badness if worst.tolerance is not None else None
    return (row.metric, _fmt(row.reference), worst.layout, _fmt(worst.abs_diff), _short(worst.rel_diff),
            _short(worst.tolerance), _short(margin),
            "[green]PASS[/green]" if row.passed else "[bold red]FAIL[/bold red]")


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
    holes = [m for m in batch.policy_token_masks() if not all(m)]
    if holes:
        fixtures.append(f"{len(holes)} sequences with tool segments ({sum(len(m) - sum(m) for m in holes)} response "
                        "tokens not the policy's)")
    if batch.value_shift is not None:
        fixtures.append(f"critic outputs shifted by {batch.value_shift:.4g} (every value < 0)")
    if fixtures:
        console.print("fixtures: " + "; ".join(fixtures))
    console.print("layouts: " + ", ".join(report.layouts) + ", token-mean (gradient scale)")
    table = Table(title=f"check-metrics: every layout against the reference ({report.mode})")
    add_columns(table)
    for row in rows(report.comparisons, report.reference):
        table.add_row(*row_cells(row))
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
        console.print("off-policy pass (perturbed old/ref log-probs, values and advantages, importance weights, "
                      "temperature "
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
