"""`rollout.engine=continuous` end to end (docs/rollout.md): single-turn and multi-turn runs resume exactly and give
the same metrics on 1 and 2 ranks (every sample draws from its own seed, so the rank never changes a token);
check-metrics passes with the other engine, generate (the default is continuous)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.e2e.test_multi_turn import (
    TOOL,
    assert_close_rows,
    assert_resumed_and_two_ranks_match,
    common,
    rows,
    write_inputs,
)

CONTINUOUS = ("rollout.engine=continuous",)


def _resume_and_two_ranks(tmp_path, args: tuple[str, ...]) -> list[dict]:
    one = run_cli("train", *args, "trainer.run_name=one", cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    reference = rows(tmp_path / "runs" / "one")
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert_resumed_and_two_ranks_match(tmp_path, args, reference)
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


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_check_metrics_passes_with_the_generate_engine(cli, nproc):
    result = cli("check-metrics", "--nproc", nproc, "rollout.engine=generate", env={"OMP_NUM_THREADS": "1"},
                 timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-metrics: PASS" in result.stdout


SHORT = ("trainer.steps=2", "rollout.prompts_per_step=4", "logging.progress=false", "trainer.eval_every=0")


@pytest.mark.parametrize("setting, fragment", [
    ("rollout.gather_weights=never", "but rollout.gather_weights=never: set rollout.engine=generate"),
    ("rollout.gather_weights_max_share=1e-12", "is more than rollout.gather_weights_max_share=1e-12 of this rank's "
                                                "free memory"),
])
def test_two_ranks_refuse_an_ungathered_continuous_engine_in_one_line(tmp_path, setting, fragment):
    """On 2 ranks the engine's ranks run their own numbers of forwards, which a sharded policy (a collective per
    layer) cannot: a setting that keeps the policy sharded is refused with one line and exit 2, not a hang or an
    out-of-memory."""
    from tests.e2e.test_own_task import one_line_error

    result = run_cli("train", "--nproc", "2", *CONTINUOUS, *SHORT, setting, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "rollout.engine=continuous runs each rank's own number of forwards" in line and fragment in line, line


def test_one_rank_generates_sharded_with_the_same_tokens(tmp_path):
    """On one rank nothing can fall out of step: rollout.gather_weights=never decodes through FSDP2's per-layer
    unshard, with the same samples and metrics as the gathered default."""
    runs = {}
    for name, extra in (("gathered", ()), ("sharded", ("rollout.gather_weights=never",))):
        result = run_cli("train", *CONTINUOUS, *SHORT, *extra, f"trainer.run_name={name}", cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[name] = rows(tmp_path / "runs" / name)
    assert [r["reward/mean"] for r in runs["sharded"]] == [r["reward/mean"] for r in runs["gathered"]]
    assert_close_rows(runs["sharded"], runs["gathered"], tol=1e-6)
