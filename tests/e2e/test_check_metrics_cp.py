"""`fsdptrain check-metrics --nproc 2 parallel.cp=2`: the ``context parallel cp=2`` layout passes on real ranks, and
each of the two CP bugs of tests/helpers/planted_bugs.py, planted on the ranks, fails it in that layout's rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]  # `tests.helpers.planted_bugs` for the ranks' sitecustomize


def _env(tmp_path: Path, bug: str | None) -> dict:
    env = {"OMP_NUM_THREADS": "1"}
    if bug is not None:
        patch_dir = tmp_path / "patch"
        patch_dir.mkdir()
        (patch_dir / "sitecustomize.py").write_text(f"from tests.helpers.planted_bugs import {bug}\n\n{bug}()\n")
        env["PYTHONPATH"] = os.pathsep.join([str(patch_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def test_cp2_layout_passes(cli, tmp_path):
    result = cli("check-metrics", "--nproc", "2", "parallel.cp=2", env=_env(tmp_path, None), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "context parallel cp=2" in result.stdout and "check-metrics: PASS" in result.stdout


@pytest.mark.parametrize("bug", ["plant_normaliser_per_cp_rank", "plant_position_ids_restarting_per_chunk"])
def test_planted_cp_bug_fails_the_cp_layout(cli, tmp_path, bug):
    result = cli("check-metrics", "--nproc", "2", "parallel.cp=2", env=_env(tmp_path, bug), timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert failures and all("context parallel cp=2]" in line for line in failures), failures
    assert "FAIL actor/loss [context parallel cp=2]" in result.stdout or "FAIL actor/" in result.stdout
