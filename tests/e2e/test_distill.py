"""On-policy distillation through the real CLI: a teacher whose vocabulary is not the student's is one line, exit 2,
before any run folder is written; a run with a matching teacher logs the typed distill/* metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.teacher_folders import save_teacher

TINY = ("algorithm=grpo", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "trainer.eval_every=0", "logging.progress=false")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return save_teacher(root / "good", sharpen=4.0), save_teacher(root / "more-tokens", extra_tokens=("zzzq",))


def test_a_teacher_with_another_vocabulary_is_one_line_exit_2_and_nothing_written(cli, tmp_path, teachers):
    run_dir = tmp_path / "runs" / "bad"
    result = cli("train", *TINY, f"algorithm.distill.teacher={teachers[1]}", f"trainer.run_dir={run_dir}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert "algorithm.distill.teacher=" in lines[0] and "has 25 tokens and the student's 24" in lines[0], lines[0]
    assert not run_dir.exists()


def test_a_distillation_run_logs_its_typed_metrics(cli, tmp_path, teachers):
    run_dir = tmp_path / "runs" / "distill"
    result = cli("train", *TINY, f"algorithm.distill.teacher={teachers[0]}", "trainer.steps=2",
                 f"trainer.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = json.loads((run_dir / "metric_kinds.json").read_text())
    assert {kinds[k] for k in ("distill/reverse_kl_mean", "distill/teacher_logprob_mean")} == {"mean"}
    assert kinds["distill/reverse_kl_max"] == "max"
    for row in rows:  # task_reward=ignore: the pg loss is the token-mean of -A = coef * kl on the first (ratio 1) pass
        assert row["distill/reverse_kl_max"] >= row["distill/reverse_kl_mean"] > 0
        assert row["actor/pg_loss"] == pytest.approx(row["distill/reverse_kl_mean"], rel=1e-5, abs=1e-6)


REPO_ROOT = Path(__file__).resolve().parents[2]  # `tests.helpers.planted_bugs` for the ranks' sitecustomize


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks: ~50 s a check
def test_check_metrics_passes_on_distillation_and_fails_the_teacher_shifted_by_one(cli, tmp_path, teachers, nproc):
    """On 2 ranks the teacher is sharded like the reference and distill/* are reduced over the ranks before the
    check compares them with their definition over every policy token."""
    args = (*TINY[:4], f"algorithm.distill.teacher={teachers[0]}", "--nproc", str(nproc))
    good = cli("check-metrics", *args, "--json", str(tmp_path / "good.json"))
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    rules = {c["rule"] for c in json.loads((tmp_path / "good.json").read_text())["checks"] if c["pass"]}
    assert "experience: distill/reverse_kl_mean = its definition" in rules
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "from tests.helpers.planted_bugs import plant_teacher_logprobs_shifted_by_one\n"
        "plant_teacher_logprobs_shifted_by_one()\n")
    env = {"PYTHONPATH": os.pathsep.join([str(patch), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    bad = cli("check-metrics", *args, "--json", str(tmp_path / "bad.json"), env=env)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    failures = json.loads((tmp_path / "bad.json").read_text())["failures"]
    assert any("distill/reverse_kl_mean" in f for f in failures), failures
    assert any("advantages = oracle" in f for f in failures), failures
