"""`fsdptrain train --nproc 2 parallel.cp=2` end to end: 3 steps, an exact resume, and the same metrics as the
data-parallel run of the same 2 ranks (which generate the same rollouts: each rank generates its own rows, and the
CP group trains their union); bad CP settings are one line, exit 2, in the parent."""

from __future__ import annotations

import pytest

from tests.conftest import metric_kinds
from tests.e2e.test_resume_export import TINY, assert_same_metrics, read_metrics

RUN = (*TINY, "trainer.steps=3")


def test_cp2_trains_resumes_exactly_and_equals_the_dp_run(cli, tmp_path):
    runs = tmp_path / "runs"
    # the DP run with the CP run's unshared rows (trainer.share_prompts=auto shares prompts there, not under CP)
    for name, extra in (("cp", ("parallel.cp=2", "checkpoint.every=1")), ("dp", ("trainer.share_prompts=false",))):
        result = cli("train", "--nproc", "2", *RUN, *extra, f"trainer.run_name={name}")
        assert result.returncode == 0, result.stderr[-3000:]
    cp, dp = read_metrics(runs / "cp"), read_metrics(runs / "dp")
    assert [m["step"] for m in cp] == [0, 1, 2]
    kinds = metric_kinds(runs / "dp")
    for got, want in zip(cp, dp):  # check-metrics' tolerance
        assert_same_metrics(got, want, kinds, tol=1e-5)

    first = cli("train", "--nproc", "2", *TINY, "trainer.steps=2", "parallel.cp=2", "checkpoint.every=1",
                "trainer.run_name=resumed")
    assert first.returncode == 0, first.stderr[-3000:]
    again = cli("train", "--nproc", "2", *RUN, "parallel.cp=2", "checkpoint.every=1", "trainer.run_name=resumed",
                "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {tmp_path}/runs/resumed/checkpoints/step_00000002 after step 2" in again.stdout, again.stdout
    for got, want in zip(read_metrics(runs / "resumed"), cp):
        assert_same_metrics(got, want, kinds)


@pytest.mark.parametrize("args, culprit", [
    (("--nproc", "2", "parallel.cp=3"), "parallel.cp=3 does not divide the world size 2"),
    (("--nproc", "2", "parallel.cp=2", "trainer.share_prompts=true"), "trainer.share_prompts=true"),
    (("--nproc", "2", "parallel.cp=2", "model.attn_backend=torch_varlen"), "model.attn_backend=auto or sdpa_segments"),
    (("--nproc", "2", "parallel.cp=2", "parallel.dp_shard=2"), "parallel.cp=2"),
])
def test_bad_cp_settings_are_one_line_exit_2(cli, args, culprit):
    result = cli("train", *args, *RUN)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ") and culprit in lines[0], lines[0]
