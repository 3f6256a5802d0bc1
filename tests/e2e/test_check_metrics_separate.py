"""`fsdptrain check-metrics` on a `rollout.placement=separate` config (fsdptrain/check/staleness.py): k = 0 checks
the colocated batch exactly, k = 1 the batch made one version stale, and an experience that takes the current weights'
log-probs as the behaviour's fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

FAST_ENV = {"OMP_NUM_THREADS": "1"}
REPO_ROOT = Path(__file__).resolve().parents[2]  # `tests.helpers.planted_bugs` for the ranks' sitecustomize
SEPARATE = ("rollout.placement=separate",)
BEHAVIOUR_RULE = "experience: behaviour log-probs = the generating forward's (weights of version t - k)"


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


def test_k0_checks_the_colocated_batch(cli, tmp_path):
    colocated, separate = tmp_path / "colocated.json", tmp_path / "separate.json"
    result = cli("check-metrics", "--nproc", "1", "--json", str(colocated), env=FAST_ENV, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    result = cli("check-metrics", "--nproc", "1", *SEPARATE, "rollout.max_staleness=0", "--json", str(separate),
                 env=FAST_ENV, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    want, got = _report(colocated), _report(separate)
    assert any("rollout.max_staleness=0" in note and "the checked batch is the colocated config's" in note
               for note in got["notes"]), got["notes"]
    # the same batch, the same numbers: every reference value and every layout's, bit for bit
    assert got["reference"] == want["reference"] and got["layouts"] == want["layouts"]
    assert got["layouts_run"] == want["layouts_run"] and got["checks"] == want["checks"]
    assert not any(c["rule"] == BEHAVIOUR_RULE for c in got["checks"])  # on-policy: no behaviour to check


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_k1_passes_on_the_batch_made_one_version_stale(cli, tmp_path, nproc):
    out = tmp_path / "check.json"
    result = cli("check-metrics", "--nproc", nproc, *SEPARATE, "rollout.max_staleness=1", "--json", str(out),
                 env=FAST_ENV, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("check-metrics: PASS") == 1
    report = _report(out)
    (behaviour,) = [c for c in report["checks"] if c["rule"] == BEHAVIOUR_RULE]
    assert behaviour["pass"] is True and behaviour["value"] == 0.0, behaviour
    assert behaviour["detail"].startswith("0 of ")
    gap = float(behaviour["detail"].rsplit("up to ", 1)[1])
    assert gap > 1e-3  # the update moved the log-probs: a behaviour from the current weights would fail
    assert any("rollout.max_staleness=1" in note for note in report["notes"])
    # off-policy: the behaviour log-probs are carried, diagnosed against the version-1 old log-probs
    assert report["reference"]["rollout_corr/kl_k3"] > 0
    assert f"ranks={nproc}" in report["layouts_run"] and report["failures"] == []


@pytest.mark.parametrize("plant", ["plant_current_weights_as_behaviour", "plant_stale_rollouts_taken_as_on_policy"])
def test_k1_fails_when_the_behaviour_is_the_current_weights(cli, tmp_path, plant):
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(f"from tests.helpers.planted_bugs import {plant}\n\n{plant}()\n")
    pythonpath = os.pathsep.join([str(patch_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", "1", *SEPARATE, "rollout.max_staleness=1",
                 env={**FAST_ENV, "PYTHONPATH": pythonpath}, timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert f"FAIL {BEHAVIOUR_RULE} [experience]: " in result.stdout
