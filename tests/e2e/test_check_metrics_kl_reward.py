"""check-metrics compares the experience on a perturbed batch too (fsdptrain/check/passes.py): on the batch as
generated the reference is the policy, so the KL penalty in the reward (``algorithm.kl_in_reward_coef``) is 0 and a
wrong sign or coefficient of it passed. Planted on the ranks (tests/helpers/planted_bugs.py), each now fails the
perturbed batch's advantages and returns (PPO with GAE: both read the penalised token rewards), on 1 and 2 ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]  # `tests.helpers.planted_bugs` for the ranks' sitecustomize
PERTURBED = "on the perturbed batch (old, reference, values; KL-in-reward coef 0.05)"


@pytest.mark.parametrize("plant, nproc", [
    ("plant_kl_penalty_sign_flipped_in_the_reward", "1"),
    ("plant_kl_penalty_sign_flipped_in_the_reward", "2"),
    ("plant_kl_penalty_coefficient_applied_twice", "1"),
    pytest.param("plant_kl_penalty_coefficient_applied_twice", "2", marks=pytest.mark.slow),  # CI budget
])
def test_a_wrong_kl_penalty_in_the_reward_fails(cli, tmp_path, plant, nproc):
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(f"from tests.helpers.planted_bugs import {plant}\n\n{plant}()\n")
    pythonpath = os.pathsep.join([str(patch_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", nproc, "algorithm.kl_in_reward_coef=0.05",
                 env={"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Traceback" not in out
    failed = {line.split("FAIL experience: ", 1)[1].split(" [experience]")[0] for line in result.stdout.splitlines()
              if line.startswith("FAIL ")}
    assert failed == {f"advantages = oracle {PERTURBED}", f"returns = oracle {PERTURBED}"}, result.stdout
