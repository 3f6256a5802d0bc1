"""`drafter.path`: a run starts from a drafter another run exported (export/drafter/, float32), trains on from it,
and refuses one saved for another policy or other drafter settings (exit 2, one line).

The exporting run is module-scoped; the first-step check runs a worker in a world of one (`tests/dist/launch.py`):
the run's drafter equals the folder's bit for bit, and its first mini-batch's drafter metrics from the train step
equal those of the per-sequence oracle with the folder's drafter loaded on its own (fp32, 1e-6 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.dist.launch import run_single
from tests.e2e.test_resume_export import read_metrics

TINY = ("rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
        "logging.progress=false")
DRAFTER = ("drafter.enabled=true", "drafter.draft_vocab_size=16", "drafter.lr=3e-3", "drafter.export_dtype=float32")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("drafter_export")
    result = run_cli("train", *TINY, *DRAFTER, "trainer.steps=2", "drafter.num_layers=2", "checkpoint.every=0",
                     f"trainer.run_dir={work / 'run'}", cwd=work)
    assert result.returncode == 0, result.stderr[-4000:]
    return work / "run" / "export" / "drafter"


@pytest.mark.slow  # CI budget: test_a_run_trains_on_from_the_saved_drafter loads the same folder
def test_a_run_starts_with_the_saved_drafter_and_its_metrics(exported, tmp_path):
    overrides = (*TINY, "trainer.steps=1", "trainer.mini_batches_per_step=1", "drafter.enabled=true",
                 "drafter.num_layers=2", f"drafter.path={exported}")
    result = run_single("drafter_path_checks.py", out_dir=tmp_path / "out", args=overrides, timeout_s=600)
    r = result.checked(1, error_free=True).results[0]["results"]
    assert r["weights_equal"] is True and r["num_weights"] > 20 and r["num_layers"] == 2
    got, want = r["train_step"], r["oracle"]
    assert set(want) == {"drafter/loss", "drafter/top1_agreement", "drafter/accept_prob",
                         "drafter/expected_accept_len@3"}
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


def test_a_run_trains_on_from_the_saved_drafter(exported, tmp_path):
    result = run_cli("train", *TINY, "trainer.steps=2", "drafter.enabled=true", "drafter.num_layers=2",
                     f"drafter.path={exported}", f"trainer.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(tmp_path / "run")
    assert all("drafter/accept_prob" in row for row in rows)  # trained from step 0: no vocabulary to count
    assert (tmp_path / "run" / "export" / "drafter" / "config.json").is_file()


@pytest.mark.parametrize("override, needle", [
    ("drafter.num_layers=1", "num_hidden_layers 2, but drafter.num_layers is 1"),
    ("model.hidden_size=32", "hidden size 64, but the policy's is 32"),
    ("drafter.draft_vocab_size=12", "draft_vocab_size 16, but drafter.draft_vocab_size is 12"),
])
def test_a_mismatched_saved_drafter_exits_2_with_one_line(cli, exported, override, needle):
    result = cli("train", *TINY, "trainer.steps=1", "drafter.enabled=true", "drafter.num_layers=2",
                 f"drafter.path={exported}", override)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_path_and_vocab_path_together_exit_2(cli, exported, tmp_path):
    result = cli("train", *TINY, "drafter.enabled=true", f"drafter.path={exported}",
                 f"drafter.vocab_path={tmp_path / 'v.json'}")
    assert result.returncode == 2 and "brings its own vocabulary" in result.stderr
