"""check-metrics, part 4: comparing every layout with the reference, and the checks each result must pass alone.

A value passes when ``|value - reference| <= atol + rtol * scale``. The scale is ``|reference|`` except for
- a loss: the same aggregation of the per-token magnitudes |L| (a loss over whitened advantages cancels to about 0,
  and fp32 summation rounds relative to its terms, not to the result);
- ``grad_max_diff`` (the largest difference over every gradient entry; its reference is 0): the largest gradient
  entry of the reference.
The "rel diff" reported is the difference over that scale. A metric present on one side only fails (an extremum that
went missing, or a 0.0 that appeared). A layout or stage that raised is one failed row naming the exception
(:func:`raised`), so a planted bug that crashes a path is reported in the table like any other.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Optional

from fsdptrain.metrics.typed import Kind

EXTREMA = ("probs_ratio", "values")  # name_min <= name_mean <= name_max
FRACTIONS = ("pg_clipfrac", "pg_clipfrac_lower", "vf_clipfrac", "response_length/truncated_frac")


def worst_of(a: float, b: float) -> float:
    """The larger of two differences, NaN when either is NaN. Python's ``max(worst, nan)`` keeps ``worst`` (NaN
    compares false), so a NaN gradient or log-prob would pass as the difference found so far; a NaN here makes
    :func:`compare` fail the value instead."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


@dataclass
class Outcome:
    """One layout's (or the reference's) finalised numbers, keyed like the trainer's log ("actor/pg_loss")."""

    layout: str
    values: dict[str, float]
    kinds: dict[str, Kind] = field(default_factory=dict)
    covers: tuple[str, ...] = ("actor/", "critic/")
    """Name prefixes this layout produces: a reference metric under one of them must be present here too."""
    error: Optional[str] = None
    """Set when the layout raised instead of producing numbers (:func:`raised`): it is then one FAIL row."""


@dataclass(frozen=True)
class Comparison:
    metric: str
    layout: str
    reference: Optional[float]
    value: Optional[float]
    abs_diff: Optional[float]
    rel_diff: Optional[float]
    passed: bool
    badness: float
    """abs_diff over the tolerance (inf when one side is missing): what makes a layout the worst, and how far from
    failing it was (it fails above 1)."""
    error: Optional[str] = None
    """What was raised when this comparison could not run (then it fails)."""
    tolerance: Optional[float] = None
    """``atol + rtol * scale``, the largest abs_diff that passes (None when there was nothing to compare)."""


@dataclass(frozen=True)
class Check:
    """A rule one result must satisfy alone (self-consistency, on-policy)."""

    rule: str
    layout: str
    value: Optional[float]
    passed: bool
    detail: str


def describe_error(error: BaseException) -> str:
    """One line: the exception, its first message line and where in fsdptrain it was raised."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "fsdptrain" in f.filename]
    where = ""
    if frames:
        path = frames[-1].filename
        where = f" (at {path[path.rfind('fsdptrain'):]}:{frames[-1].lineno})"
    message = str(error).strip().splitlines()
    return f"raised {type(error).__name__}: {message[0] if message else ''}{where}"


def raised(stage: str, layout: str, error: BaseException) -> Comparison:
    """A failed row for a stage or a layout that raised: check-metrics reports a bug, it does not crash on it."""
    return Comparison(stage, layout, None, None, None, None, False, math.inf, error=describe_error(error))


def _covered(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name.startswith(p) for p in prefixes)


def compare(reference: Outcome, outcome: Outcome, *, rtol: float, atol: float, scales: dict[str, float],
            skip: frozenset[str] = frozenset()) -> list[Comparison]:
    """Every metric of ``outcome`` (and every reference metric it covers) against the reference."""
    if outcome.error is not None:
        return [Comparison("(raised)", outcome.layout, None, None, None, None, False, math.inf, error=outcome.error)]
    names = {n for n in reference.values if _covered(n, outcome.covers)} | set(outcome.values)
    out = []
    for name in sorted(names - skip):
        ref, value = reference.values.get(name), outcome.values.get(name)
        if ref is None or value is None or not (math.isfinite(ref) and math.isfinite(value)):
            out.append(Comparison(name, outcome.layout, ref, value, None, None, False, math.inf))
            continue
        scale = scales.get(name, abs(ref))
        diff = abs(value - ref)
        tolerance = atol + rtol * scale
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        out.append(Comparison(name, outcome.layout, ref, value, diff, rel, diff <= tolerance,
                              diff / tolerance if tolerance > 0 else (0.0 if diff == 0 else math.inf),
                              tolerance=tolerance))
    return out


def self_checks(outcome: Outcome, *, rtol: float, atol: float, on_policy: bool) -> list[Check]:
    """min <= mean <= max, fractions in [0, 1], SUM counts whole numbers, and (on-policy) ratio 1, clip fraction 0."""
    v, layout, out = outcome.values, outcome.layout, []
    for prefix in ("actor/", "critic/"):
        for base in EXTREMA:
            lo, mean, hi = (v.get(f"{prefix}{base}_{s}") for s in ("min", "mean", "max"))
            if None in (lo, mean, hi):
                continue
            slack = atol + rtol * max(abs(lo), abs(hi))
            ok = lo <= mean + slack and mean <= hi + slack
            out.append(Check(f"{prefix}{base}: min <= mean <= max", layout, mean, ok,
                             f"min {lo:.6g}, mean {mean:.6g}, max {hi:.6g}"))
    for name, value in v.items():
        base = name.split("/", 1)[1] if name.startswith(("actor/", "critic/")) else name
        if base in FRACTIONS and not -atol <= value <= 1 + atol:
            out.append(Check(f"{name} in [0, 1]", layout, value, False, f"{value:.6g}"))
        if outcome.kinds.get(name) is Kind.SUM and abs(value - round(value)) > atol:
            out.append(Check(f"{name} is a whole count", layout, value, False, f"{value!r}"))
    if on_policy and "actor/probs_ratio_min" in v:
        dev = max(abs(v["actor/probs_ratio_min"] - 1.0), abs(v["actor/probs_ratio_max"] - 1.0))
        out.append(Check("on-policy: max |ratio - 1| = 0", layout, dev, dev <= atol + rtol, f"{dev:.3g}"))
        clip = v.get("actor/pg_clipfrac", 0.0) + v.get("actor/pg_clipfrac_lower", 0.0)
        out.append(Check("on-policy: clip fractions = 0", layout, clip, clip <= atol, f"{clip:.3g}"))
    return out


@dataclass
class MetricRow:
    """One line of the table: a metric over every layout that reports it."""

    metric: str
    reference: Optional[float]
    worst: Comparison

    @property
    def passed(self) -> bool:
        return self.worst.passed


def rows(comparisons: list[Comparison], reference: Outcome) -> list[MetricRow]:
    """Per metric, the worst layout (largest difference over tolerance), in the reference's order, extras last."""
    worst: dict[str, Comparison] = {}
    for c in comparisons:
        if c.metric not in worst or c.badness > worst[c.metric].badness:
            worst[c.metric] = c
    order = [n for n in reference.values if n in worst] + sorted(n for n in worst if n not in reference.values)
    out = []
    for name in order:
        w = worst[name]
        max_abs = max((c.abs_diff for c in comparisons if c.metric == name and c.abs_diff is not None), default=None)
        max_rel = max((c.rel_diff for c in comparisons if c.metric == name and c.rel_diff is not None), default=None)
        out.append(MetricRow(name, reference.values.get(name),
                             Comparison(w.metric, w.layout, w.reference, w.value, max_abs, max_rel, w.passed,
                                        w.badness, tolerance=w.tolerance)))
    return out


def failure_lines(comparisons: list[Comparison], checks: list[Check]) -> list[str]:
    """One line per failure, naming the metric and the layout."""
    out = []
    for c in comparisons:
        if c.passed:
            continue
        if c.error is not None:
            out.append(f"FAIL {c.metric} [{c.layout}]: {c.error}")
        elif c.reference is None or c.value is None:
            side = "the reference" if c.reference is None else "this layout"
            out.append(f"FAIL {c.metric} [{c.layout}]: absent in {side} (reference {c.reference}, value {c.value})")
        else:
            out.append(f"FAIL {c.metric} [{c.layout}]: reference {c.reference:.9g}, value {c.value:.9g}, "
                       f"|diff| {c.abs_diff:.3g} (rel {c.rel_diff:.3g})")
    out += [f"FAIL {k.rule} [{k.layout}]: {k.detail}" for k in checks if not k.passed]
    return out


def _number(x: Optional[float]):
    """JSON has no inf or NaN: those become the strings "inf", "-inf", "nan"; a missing value is null."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def to_json(comparisons: list[Comparison], checks: list[Check]) -> dict:
    """Per layout and metric: reference, value, abs_diff, rel_diff, tolerance, margin (abs_diff / tolerance), pass;
    then the checks."""
    layouts: dict[str, dict] = {}
    for c in comparisons:
        entry = {"reference": _number(c.reference), "value": _number(c.value), "abs_diff": _number(c.abs_diff),
                 "rel_diff": _number(c.rel_diff), "tolerance": _number(c.tolerance),
                 "margin": _number(c.badness) if c.tolerance is not None else None, "pass": c.passed}
        layouts.setdefault(c.layout, {})[c.metric] = entry if c.error is None else {**entry, "error": c.error}
    return {"layouts": layouts,
            "checks": [{"rule": k.rule, "layout": k.layout, "value": _number(k.value), "pass": k.passed,
                        "detail": k.detail} for k in checks]}
