"""`fsdptrain plot`: the curves of a run's metrics.jsonl in one PNG.

Each line of `run_dir/metrics.jsonl` is one JSON object with `step` and metric keys. One small panel per metric
family in PANELS order (reward, eval reward, policy and value losses, grad norms, KL, entropy, response length),
skipping families with no key in the file. A key belongs to a family when one of the family's names appears in it as
whole "/"-separated segments (`train/reward/mean` and `reward/mean` are rewards; `critic/grad_norm` a grad norm);
a key that matches two names goes to the one with more segments, then to the one that starts earlier
(`eval/reward/mean` is an eval reward, not a reward). Non-numeric and
non-finite values are left out of the curves.

matplotlib is an optional extra (`pip install 'fsdptrain[plot]'`); it is imported only here, with the Agg backend.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

from fsdptrain.registry.errors import OutputNotWritten
from fsdptrain.registry.user_paths import output_path, user_path

# (panel title, metric names it gathers)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("eval reward", ("eval/reward",)),
    ("policy loss", ("actor/pg_loss",)),
    ("value loss", ("critic/vf_loss",)),
    ("grad norm", ("actor/grad_norm", "critic/grad_norm")),
    ("KL", ("actor/kl",)),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean",)),
)
METRICS_FILE = "metrics.jsonl"
PLOT_EXTRA_HINT = "pip install 'fsdptrain[plot]' (or pip install matplotlib)"


class PlotDependencyError(ValueError):
    """matplotlib is not installed."""


def _match_start(key: str, name: str) -> int | None:
    """The segment index where `name`'s segments appear contiguously in `key`'s, or None."""
    key_parts, name_parts = key.split("/"), name.split("/")
    for start in range(len(key_parts) - len(name_parts) + 1):
        if key_parts[start : start + len(name_parts)] == name_parts:
            return start
    return None


def panel_of(key: str) -> str | None:
    """The title of the panel `key` is drawn in, or None (see the module docstring for the rule)."""
    best: tuple[int, int] | None = None
    best_title = None
    for title, names in PANELS:
        for name in names:
            start = _match_start(key, name)
            if start is None:
                continue
            rank = (-len(name.split("/")), start)
            if best is None or rank < best:
                best, best_title = rank, title
    return best_title


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl file, in file order. Blank lines are skipped; a malformed line is a
    ValueError naming file:line."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object ({err.msg}); fix or delete that line") from None
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(f"{path}:{number}: each line must be a JSON object with a 'step' key")
            records.append(record)
    return records


def collect_series(records: list[dict]) -> list[tuple[str, dict[str, tuple[list[float], list[float]]]]]:
    """[(panel title, {metric key: (steps, values)})] for the panels that have at least one point."""
    by_panel: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for record in records:
        for key, value in record.items():
            title = panel_of(key)
            if title is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            steps, values = by_panel.setdefault(title, {}).setdefault(key, ([], []))
            steps.append(record["step"])
            values.append(float(value))
    return [(title, dict(sorted(by_panel[title].items()))) for title, _ in PANELS if title in by_panel]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotDependencyError(f"plotting needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draw the run's metrics to a PNG (default run_dir/metrics.png) and return its path.

    Raises ValueError when the run directory or its metrics.jsonl is missing, is not a folder or a regular file (a
    named pipe), or holds none of the plotted metrics, PlotDependencyError (a ValueError) when matplotlib is not
    installed, OutputNotWritten when the PNG cannot be written.
    """
    run_dir = Path(run_dir)
    if run_dir.exists():
        user_path(run_dir, key="RUN_DIR", expect="folder")
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the folder of a run (runs/<run_name>)")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        raise ValueError(f"{metrics_path} does not exist: has this run logged a step yet?")
    user_path(metrics_path, key="RUN_DIR/metrics.jsonl")  # a named pipe would hold the read below forever
    panels = collect_series(read_metrics(metrics_path))
    if not panels:
        known = ", ".join(name for _, names in PANELS for name in names)
        raise ValueError(f"{metrics_path} holds none of the plotted metrics ({known})")
    out_path = Path(out) if out is not None else run_dir / "metrics.png"
    output_path(out_path, option="--out")

    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    num_cols = min(3, len(panels))
    num_rows = math.ceil(len(panels) / num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(4.2 * num_cols, 3.0 * num_rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels):
        for key, (steps, values) in series.items():
            ax.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()  # drawn in memory, written by us: matplotlib's writers do not all report a failed write
    try:
        fig.savefig(image, format=out_path.suffix[1:].lower() or None, dpi=100)
    finally:
        plt.close(fig)
    try:
        out_path.write_bytes(image.getvalue())
    except OSError as err:  # a full disk, a folder made read-only since the check
        raise OutputNotWritten("--out", str(out_path), err) from None
    return out_path
