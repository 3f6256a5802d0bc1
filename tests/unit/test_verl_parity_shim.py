"""The verl translation layer (tests/verl_parity/shim) still imports and routes to fsdptrain: a small test of our own,
written in verl's calling conventions, run through scripts/run_verl_parity.py in a subprocess (the shim's `verl`
package never enters this process)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECKS = '''
import enum
import math

import numpy as np
import pytest
import torch

import verl.trainer.ppo.core_algos as core
from verl.trainer.ppo.metric_utils import calc_maj_val, process_validation_metrics
from verl.trainer.ppo.mismatch_helper import compute_rollout_importance_weights
from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics, compute_rollout_correction_and_rejection_mask
from verl.utils.metric import reduce_metrics


def test_names_route_to_fsdptrain():
    class Estimators(enum.Enum):
        MINE = "verl_parity_mine"

    fn = core.register_adv_est(Estimators.MINE)(lambda **_: None)
    assert core.get_adv_estimator_fn("verl_parity_mine") is fn
    # GRPO by hand: scores 1, 3 in one group: mean 2, unbiased std sqrt(2): -1/sqrt(2), 1/sqrt(2)
    a, _ = core.compute_grpo_outcome_advantage(torch.tensor([[0.0, 1.0], [3.0, 0.0]]), torch.ones(2, 2),
                                               np.array([7, 7]))
    assert torch.allclose(a, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]) / (math.sqrt(2) + 1e-6), rtol=0, atol=1e-7)
    # GAE over one token: A = r - V
    a, r = core.compute_gae_advantage_return(torch.tensor([[1.0]]), torch.tensor([[0.25]]), torch.ones(1, 1), 1.0, 1.0)
    assert a.item() == 0.75 and r.item() == 1.0


def test_rollout_correction_routes_to_fsdptrain():
    old = torch.zeros(2, 2)
    behaviour = torch.tensor([[0.0, -math.log(4.0)], [0.0, 0.0]])
    proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old, behaviour, torch.ones(2, 2), rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
        rollout_rs_threshold=3.0, rollout_token_veto_threshold=1e-4)
    assert proto.batch["rollout_is_weights"].tolist() == [[1.0, 2.0], [1.0, 1.0]]  # ratio old/behaviour 4, capped
    assert mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]  # 4 > 3: rejected
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.25
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == 0.0
    assert compute_offpolicy_metrics(old, None, torch.ones(2, 2)) == {"training_ppl": 1.0, "training_log_ppl": 0.0}
    _, _, named = compute_rollout_importance_weights(old, behaviour, torch.ones(2, 2), rollout_is_threshold=2.0)
    assert math.isclose(named["mismatch/mismatch_chi2_token"], (1 + 16 + 1 + 1) / 4 - 1, rel_tol=1e-6)
    # a divergence option goes through fsdptrain's config: k2 of ln 4 is (ln 4)^2 / 2 = 0.96 > 0.5, rejected
    _, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old, behaviour, torch.ones(2, 2), rollout_rs="token_k2", rollout_rs_threshold=0.5)
    assert mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert math.isclose(metrics["rollout_corr/rollout_rs_token_k2_mean"], math.log(4.0) ** 2 / 8, rel_tol=1e-6)
    with pytest.raises(ValueError, match="rollout_rejection_divergence_max=0.0 must be a finite number > 0"):
        compute_rollout_correction_and_rejection_mask(old, behaviour, torch.ones(2, 2), rollout_rs="token_k2",
                                                      rollout_rs_threshold=0.0)


def test_metric_utils_route_to_fsdptrain():
    assert reduce_metrics({"a": [1.0, 2.0], "b": []})["a"] == 1.5
    assert calc_maj_val([{"p": "A", "v": 0.9}, {"p": "B", "v": 0.8}, {"p": "A", "v": 0.7}], "p", "v") == 0.9
    out = process_validation_metrics(["s", "s"], ["q", "q"], {"score": [0.8, 0.9]})
    assert math.isclose(out["s"]["score"]["mean@2"], 0.85)


def test_no_name_is_put_on_a_different_quantity():
    # r = 4 on one token: the k1 rejection keeps -log r in [ln 0.5, ln 2], so r in [0.5, 2]: that token goes. verl's
    # rollout_rs_token_k1_mean is the mean of -log r, which fsdptrain does not log: the name must be absent, not the
    # mean of r (1.75) under it; nor fsdptrain's share of emptied sequences under verl's rollout_rs_seq_masked_fraction.
    old = torch.zeros(2, 2)
    behaviour = torch.tensor([[0.0, -math.log(4.0)], [0.0, 0.0]])
    _, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old, behaviour, torch.ones(2, 2), rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    assert mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert not any(k.endswith("rollout_rs_token_k1_mean") or k.endswith("rollout_rs_seq_masked_fraction")
                   for k in metrics), sorted(metrics)
'''


def test_the_shim_runs_a_verl_style_test_through_the_runner(tmp_path):
    test_file = tmp_path / "test_verl_style.py"
    test_file.write_text(CHECKS)
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "run_verl_parity.py"), str(test_file), "--",
                             "-q", "-p", "no:randomly"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout


def test_the_runner_refuses_a_missing_path_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "run_verl_parity.py"), str(tmp_path / "nope")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == f"run_verl_parity.py: no such path: {tmp_path / 'nope'}"
