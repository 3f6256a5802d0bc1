"""What a run writes to its directory besides checkpoints: metrics.jsonl, metric_kinds.json, samples.jsonl
(docs/metrics.md)."""

from __future__ import annotations

import json
from pathlib import Path

from fsdptrain.storage.atomic import append_line, write_atomic

METRIC_KINDS_FILE = "metric_kinds.json"
FACT = "fact"
"""The kind recorded for a logged number that is no typed metric: the loop's own fact (a grad norm, the lr, ...)."""


def metric_kinds(result: dict, typed: dict[str, str]) -> dict[str, str]:
    """The kind of every number of a metrics line but ``step``: the typed metric's kind, else ``fact``."""
    return {name: typed.get(name, FACT) for name in result if name != "step"}


def write_metric_kinds(path: Path, kinds: dict[str, str]) -> None:
    """``metric_kinds.json``: name -> kind of every number metrics.jsonl has held (docs/metrics.md), replaced
    atomically whenever a new name appears."""
    write_atomic(path, json.dumps(dict(sorted(kinds.items())), indent=1) + "\n")


def read_metric_kinds(path: Path) -> dict[str, str]:
    """What :func:`write_metric_kinds` wrote, or nothing when the file is absent."""
    return json.loads(path.read_text()) if path.exists() else {}


def write_metrics_line(path: Path, result: dict) -> None:
    """One line per step, in one write: a crash leaves at most a partial last line, which resume drops."""
    append_line(path, json.dumps(result))


def write_samples(path: Path, step: int, samples: list[dict]) -> None:
    """Append a step's shown samples to samples.jsonl: one line per sample with the step, prompt, completion and
    each reward function's score (null where it did not apply); a multi-turn sample adds its ``turns`` (messages with
    their tool calls and results) and ``truncated`` (the cause or null, docs/multi-turn.md)."""
    with path.open("a") as handle:
        for sample in samples:
            handle.write(json.dumps({"step": step, **sample}) + "\n")


class MetricsFiles:
    """A run's metrics.jsonl and metric_kinds.json, written by the main rank after each step (both recipes)."""

    def __init__(self, run_dir: Path, *, resumed: bool):
        self.metrics_path, self.kinds_path = run_dir / "metrics.jsonl", run_dir / METRIC_KINDS_FILE
        self.logged_kinds = read_metric_kinds(self.kinds_path) if resumed else {}

    def write(self, result: dict, typed: dict[str, str]) -> None:
        """The step's line, and the kinds file again when a new name (or kind) appears (``typed``: the typed
        metrics' kinds)."""
        write_metrics_line(self.metrics_path, result)
        now = metric_kinds(result, typed)
        if not now.items() <= self.logged_kinds.items():
            self.logged_kinds.update(now)
            write_metric_kinds(self.kinds_path, self.logged_kinds)
