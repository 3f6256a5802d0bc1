"""fsdptrain.plot: which keys land in which panel, the PNG itself, and the errors (missing run, file, matplotlib)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdptrain.plot import PlotDependencyError, collect_series, panel_of, plot_run, read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

RECORDS = [
    {"step": 1, "reward/mean": 0.1, "actor/pg_loss": 0.5, "actor/grad_norm": 2.0, "critic/grad_norm": 3.0,
     "actor/kl": float("nan"), "timing/step_s": 1.2},
    {"step": 2, "reward/mean": 0.3, "eval/reward/mean": 0.25, "actor/pg_loss": 0.4, "actor/grad_norm": 1.5,
     "critic/grad_norm": 2.5, "actor/kl": 0.01, "note": "text"},
    {"step": 3, "reward/mean": 0.6, "actor/pg_loss": 0.2, "actor/grad_norm": 1.0, "critic/grad_norm": 2.0,
     "actor/kl": 0.02},
]


def _write_run(tmp_path: Path, records=RECORDS) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # json.dumps writes the NaN as `NaN`, which json.loads reads back (the trainer's writer may do the same).
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    return run_dir


@pytest.mark.parametrize(
    ("key", "panel"),
    [
        ("reward/mean", "reward"),
        ("train/reward/mean", "reward"),
        ("eval/reward", "eval reward"),
        ("eval/reward/mean", "eval reward"),  # matches reward/mean too; the earlier start wins
        ("critic/grad_norm", "grad norm"),
        ("actor/pg_loss", "policy loss"),
        ("critic/vf_loss", "value loss"),
        ("actor/entropy", "entropy"),
        ("response_length/mean", "response length"),
        ("reward/std", None),
        ("myreward/mean", None),  # whole segments only
        ("actor/pg_loss_extra", None),
    ],
)
def test_panel_of(key, panel):
    assert panel_of(key) == panel


def test_collect_series_skips_absent_non_numeric_and_non_finite(tmp_path):
    panels = collect_series(read_metrics(_write_run(tmp_path) / "metrics.jsonl"))
    assert panels == [
        ("reward", {"reward/mean": ([1, 2, 3], [0.1, 0.3, 0.6])}),
        ("eval reward", {"eval/reward/mean": ([2], [0.25])}),
        ("policy loss", {"actor/pg_loss": ([1, 2, 3], [0.5, 0.4, 0.2])}),
        ("grad norm", {"actor/grad_norm": ([1, 2, 3], [2.0, 1.5, 1.0]),
                       "critic/grad_norm": ([1, 2, 3], [3.0, 2.5, 2.0])}),
        ("KL", {"actor/kl": ([2, 3], [0.01, 0.02])}),  # the NaN of step 1 is left out
    ]


def test_plot_run_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    run_dir = _write_run(tmp_path)
    out = plot_run(run_dir, None)
    assert out == run_dir / "metrics.png"
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(out)
    # 5 panels -> 3 columns x 2 rows of 4.2 x 3.0 inches at 100 dpi: 1260 x 600 pixels, RGBA
    assert pixels.shape == (600, 1260, 4)
    assert pixels[..., :3].std() > 0.01  # something was drawn

    custom = plot_run(run_dir, tmp_path / "plots" / "curves.png")
    assert custom == tmp_path / "plots" / "curves.png"
    assert custom.read_bytes()[:8] == PNG_SIGNATURE


def test_missing_run_dir_and_metrics_file(tmp_path):
    with pytest.raises(ValueError, match="run directory .*nope does not exist"):
        plot_run(tmp_path / "nope", None)
    with pytest.raises(ValueError, match="metrics.jsonl does not exist"):
        plot_run(tmp_path, None)


def test_bad_line_and_no_plotted_metric(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 1.0}\n{"step": 2,\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        plot_run(tmp_path, None)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "timing/step_s": 1.0}\n')
    with pytest.raises(ValueError, match="holds none of the plotted metrics"):
        plot_run(tmp_path, None)


def test_missing_matplotlib_is_a_clear_error(tmp_path):
    # A real interpreter in which `import matplotlib` fails: a sitecustomize installs a finder that refuses it.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent("""
        import importlib.abc, sys

        class NoMatplotlib(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if fullname == "matplotlib" or fullname.startswith("matplotlib."):
                    raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
                return None

        sys.meta_path.insert(0, NoMatplotlib())
    """))
    run_dir = _write_run(tmp_path)
    script = textwrap.dedent(f"""
        from fsdptrain.plot import PlotDependencyError, plot_run
        try:
            plot_run({str(run_dir)!r}, None)
        except PlotDependencyError as err:
            print("ValueError" if isinstance(err, ValueError) else "other", err)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO_ROOT)])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ValueError plotting needs matplotlib"), proc.stdout
    assert "pip install 'fsdptrain[plot]'" in proc.stdout
    assert not (run_dir / "metrics.png").exists()
    assert issubclass(PlotDependencyError, ValueError)
