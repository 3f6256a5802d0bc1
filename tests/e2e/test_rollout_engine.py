"""`rollout.engine=continuous` end to end (docs/rollout.md): single-turn and multi-turn runs resume exactly and give
the same metrics on 1 and 2 ranks (every sample draws from its own seed, so the rank never changes a token);
check-metrics passes with the other engine, generate (the default is continuous)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.e2e.test_multi_turn import TOOL, assert_close_rows, common, rows, write_inputs
from tests.e2e.test_resume_export import copy_checkpoint

CONTINUOUS = ("rollout.engine=continuous",)


def _resume_and_two_ranks(tmp_path, args: tuple[str, ...]) -> list[dict]:
    one = run_cli("train", *args, "trainer.run_name=one", cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    reference = rows(tmp_path / "runs" / "one")
    assert [r["step"] for r in reference] == [0, 1, 2]
    copy_checkpoint(tmp_path / "runs" / "one", 2, tmp_path / "runs" / "resumed")
    resumed = run_cli("train", *args, "trainer.run_name=resumed", "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_close_rows(rows(tmp_path / "runs" / "resumed"), reference[2:], tol=1e-6)
    two = run_cli("train", "--nproc", "2", *args, "trainer.run_name=two", cwd=tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    assert_close_rows(rows(tmp_path / "runs" / "two"), reference, tol=1e-5)
    return reference


def test_single_turn_resumes_exactly_and_two_ranks_equal_one(tmp_path):
    reference = _resume_and_two_ranks(tmp_path, (*CONTINUOUS, "trainer.steps=3", "checkpoint.every=2",
                                                 "rollout.prompts_per_step=4", "logging.progress=false"))
    assert all(r["reward/mean"] == r["reward/mean"] for r in reference)


def test_multi_turn_resumes_exactly_and_two_ranks_equal_one(tmp_path):
    write_inputs(tmp_path)
    evaluation = ("trainer.eval_every=2", "trainer.eval_n=2")
    args = (*[a for a in common(tmp_path) if not a.startswith("trainer.eval_every=")], *evaluation, *TOOL,
            *CONTINUOUS, "trainer.steps=3", "checkpoint.every=2")
    reference = _resume_and_two_ranks(tmp_path, args)
    assert reference[0]["tools/call_frequency"] > 0 and reference[0]["turns/max"] >= 2


@pytest.mark.slow  # the default engine is continuous: tests/e2e/test_check_metrics_cli.py runs it in CI
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_check_metrics_passes_with_the_generate_engine(cli, nproc):
    result = cli("check-metrics", "--nproc", nproc, "rollout.engine=generate", env={"OMP_NUM_THREADS": "1"},
                 timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-metrics: PASS" in result.stdout
