"""`fsdptrain check-metrics` as a user runs it: exit codes, the table, `--json`, and a bug planted on real ranks."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from fsdptrain.rl.aggregate import AGG_MODES

FAST_ENV = {"OMP_NUM_THREADS": "1"}
REPO_ROOT = Path(__file__).resolve().parents[2]  # `tests.helpers.planted_bugs` for the ranks' sitecustomize


def _env(**extra: str) -> dict:
    return {**FAST_ENV, **extra}


def test_nproc_1_passes_and_writes_json(cli, tmp_path):
    out = tmp_path / "check.json"
    result = cli("check-metrics", "--nproc", "1", "--json", str(out), env=_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-metrics: PASS" in result.stdout
    assert "normalisation: token-mean" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["failures"] == []
    layouts = report["layouts_run"]
    for prefix in ("per-sequence", "padded", "packed budget=", "micro-batches=1", "micro-batches=2",
                   "simulated dp=2", "ranks=1"):
        assert any(name.startswith(prefix) for name in layouts), (prefix, layouts)
    assert any(name.endswith("(one sequence each)") for name in layouts), layouts
    update = report["layouts"].pop("mini-batches=2 x epochs=2")  # the update pass: rows of its own (update/*)
    assert update["update/actor/pg_loss"]["pass"] is True and update["update/loss/global_num_tokens"]["pass"] is True
    for layout in [name for name in layouts if name in report["layouts"]]:
        prefix = "off-policy/" if layout.startswith("off-policy: ") else ""
        for name in ("actor/loss", "actor/grad_norm", "actor/probs_ratio_min", "critic/values_max",
                     "critic/vf_loss"):
            metric = prefix + name
            entry = report["layouts"][layout][metric]
            assert set(entry) == {"reference", "value", "abs_diff", "rel_diff", "tolerance", "margin", "pass"}, (
                layout, metric)
            assert entry["pass"] is True and entry["margin"] <= 1
            assert entry["margin"] == pytest.approx(entry["abs_diff"] / entry["tolerance"], rel=1e-12)
            assert entry["reference"] == report["reference"][metric]
            assert entry["abs_diff"] == pytest.approx(abs(entry["value"] - entry["reference"]), abs=1e-12)
    num_seqs = report["layouts"]["ranks=1"]["batch/num_seqs"]
    assert num_seqs["value"] == num_seqs["reference"] > 0


def test_nproc_2_passes(cli):
    result = cli("check-metrics", "--nproc", "2", env=_env(), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on 2 rank(s)" in result.stdout
    assert result.stdout.count("check-metrics: PASS") == 1  # rank 0 alone reports


@pytest.mark.slow  # CI budget: the same planted bug is caught on simulated ranks in tests/unit/test_check_metrics.py
def test_missing_dp_size_factor_on_real_ranks_fails(cli, tmp_path):
    # The bug lives in a patch module on the ranks' Python path, not in the product: every rank believes the
    # data-parallel size is 1, so no loss carries the factor that cancels FSDP2's gradient mean over the 2 ranks.
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(textwrap.dedent("""\
        import fsdptrain.distributed.world

        fsdptrain.distributed.world.dp_size = lambda mesh: 1
        """))
    pythonpath = os.pathsep.join([str(patch_dir), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", "2", env=_env(PYTHONPATH=pythonpath), timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL actor/grad_norm [ranks=2]" in result.stdout
    assert "FAIL critic/loss [ranks=2]" in result.stdout
    assert "[simulated dp=2]" not in result.stdout  # the simulated layout does not ask dist for the dp size


def test_json_into_a_missing_folder_is_a_usage_error(cli, tmp_path):
    result = cli("check-metrics", "--json", str(tmp_path / "nope" / "check.json"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["1", "2"])
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_full_matrix(cli, mode, algorithm, nproc):
    result = cli("check-metrics", "--nproc", nproc, f"algorithm={algorithm}", f"loss.agg_mode={mode}", env=_env(),
                 timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-metrics: PASS" in result.stdout


@pytest.mark.slow  # CI time; tests/dist/test_whitening.py proves two ranks whiten with the global moments
def test_whitening_over_the_local_rank_fails_on_2_ranks(cli, tmp_path):
    # Planted on the ranks: the whitening moments are not summed over ranks, so each rank whitens its own share.
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(textwrap.dedent("""\
        import fsdptrain.train.experience

        fsdptrain.train.experience._sum_over_ranks = lambda stats: stats
        """))
    pythonpath = os.pathsep.join([str(patch_dir), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", "2", env=_env(PYTHONPATH=pythonpath), timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL experience: advantages = oracle (global whitening) [experience]" in result.stdout


# Every estimator, policy loss and KL estimator added with the registries, at least once in CI (1 rank, the mode the
# combination stresses most), and the whole product by hand (`pytest -m slow`) on 1 and 2 ranks.
BREADTH = [
    ("algorithm=grpo", "algorithm.policy_loss=cispo", "algorithm.adv_estimator=reinforce_plus_plus",
     "loss.agg_mode=token-sum"),
    ("algorithm=grpo", "algorithm.policy_loss=gmpo", "algorithm.adv_estimator=reinforce_plus_plus_baseline",
     "loss.agg_mode=seq-mean-token-mean", "algorithm.use_kl_loss=true", "algorithm.kl_estimator=k3+"),
    ("algorithm=grpo", "algorithm.policy_loss=dro", "algorithm.dro_beta=1.0", "algorithm.adv_estimator=rloo",
     "loss.agg_mode=seq-mean-token-sum-norm", "algorithm.use_kl_loss=true", "algorithm.kl_estimator=mse"),
]
# Not `abs`: |log r| has no gradient at r = 1, so on the on-policy pass its gradient is the sign of a rounding error
# (+-kl_coef per token) and differs between layouts by construction (docs/algorithms.md).


# CI runs two of the three (budget); the third is by hand (pytest -m slow)
@pytest.mark.parametrize("overrides", [*BREADTH[:2], pytest.param(BREADTH[2], marks=pytest.mark.slow)],
                         ids=["cispo-rpp", "gmpo-rpp_baseline-k3+", "dro-rloo-mse"])
def test_new_losses_and_estimators_are_exact_across_layouts(cli, overrides):
    result = cli("check-metrics", "--nproc", "1", *overrides, env=_env(), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-metrics: PASS" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["1", "2"])
@pytest.mark.parametrize("loss", ["vanilla", "cispo", "gmpo", "dro"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "mse", "k1+", "k3+", "abs+"])
def test_breadth_matrix(cli, nproc, loss, estimator, kl):
    result = cli("check-metrics", "--nproc", nproc, "algorithm=grpo", f"algorithm.policy_loss={loss}",
                 "algorithm.dro_beta=1.0", f"algorithm.adv_estimator={estimator}", "algorithm.use_kl_loss=true", f"algorithm.kl_estimator={kl}",
                 env=_env(), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


DRAFTER_ROWS = ("drafter/loss", "drafter/top1_agreement", "drafter/accept_prob", "drafter/expected_accept_len@3",
                "drafter/grad_norm", "drafter/grad_max_diff")


@pytest.mark.slow  # CI budget: the drafter step is exact on 2 ranks vs 1 process in tests/dist/test_drafter_step.py
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_drafter_rows_pass_in_every_layout(cli, tmp_path, nproc):
    out = tmp_path / "check.json"
    result = cli("check-metrics", "--nproc", nproc, "drafter.enabled=true", "--json", str(out), env=_env(),
                 timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    on_policy = [name for name in report["layouts_run"]
                 if not name.startswith("off-policy: ") and " x epochs=" not in name]  # not the update pass
    assert len(on_policy) >= (8 if nproc == "1" else 7)  # `simulated dp` runs on one rank only
    for layout in on_policy:
        for name in DRAFTER_ROWS:
            entry = report["layouts"][layout][name]
            assert entry["pass"] is True and entry["reference"] == report["reference"][name], (layout, name)
    assert 0 < report["reference"]["drafter/accept_prob"] < 1 and report["reference"]["drafter/grad_norm"] > 0
    assert f"ranks={nproc}" in on_policy


def test_a_drafter_metric_over_unscored_positions_fails(cli, tmp_path):
    # Planted on the product: the drafter's means count every row position, not the scored ones only.
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(textwrap.dedent("""\
        import torch
        import fsdptrain.rl.draft_loss as draft_loss

        original = draft_loss.draft_metrics
        draft_loss.draft_metrics = lambda loss, agree, accept, mask, dp: original(
            loss, agree, accept, torch.ones_like(mask), dp)
        """))
    pythonpath = os.pathsep.join([str(patch_dir), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", "1", "drafter.enabled=true", env=_env(PYTHONPATH=pythonpath),
                 timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL drafter/accept_prob [packed budget=" in result.stdout
    assert "FAIL actor/" not in result.stdout


# Three bugs from the anchors' trainers, planted together on the ranks (each shows in rows of its own):
# - the grad norm over this rank's shards only (SkyRL #211): each rank logs and clips by its own norm;
# - the loss normaliser counted over the whole step instead of the mini-batch (TRL #6024);
# - a sequence's importance weight from the mean of its token log-ratios instead of their sum (TRL #5814).
THREE_BUGS = """\
from tests.helpers.planted_bugs import (
    plant_grad_norm_over_local_shards,
    plant_normaliser_over_the_whole_step,
    plant_sequence_weight_from_mean_log_ratio,
)

plant_grad_norm_over_local_shards()
plant_normaliser_over_the_whole_step()
plant_sequence_weight_from_mean_log_ratio()
"""
SEQUENCE_TIS = ("algorithm.rollout_correction=tis", "algorithm.rollout_correction_level=sequence")


@pytest.mark.parametrize("nproc", ["1", pytest.param("2", marks=pytest.mark.slow)])  # CI: 1 (budget)
def test_three_planted_bugs_fail_with_clean_rows(cli, tmp_path, nproc):
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(THREE_BUGS)
    pythonpath = os.pathsep.join([str(patch_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", nproc, *SEQUENCE_TIS, env=_env(PYTHONPATH=pythonpath), timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "check-metrics: FAIL" in result.stdout
    assert "FAIL update/loss/global_num_tokens [mini-batches=2 x epochs=2]" in result.stdout
    assert "FAIL experience/is_weights_max_diff [experience]" in result.stdout
    if nproc == "2":  # on one rank its shards are every shard: that norm is the global one
        assert "FAIL actor/grad_norm [ranks=2]" in result.stdout and "FAIL actor/clip_coef [ranks=2]" in result.stdout


@pytest.mark.parametrize("nproc", ["1", pytest.param("2", marks=pytest.mark.slow)])  # CI: 1 (budget)
def test_several_mini_batches_epochs_and_rollout_correction_pass(cli, nproc):
    result = cli("check-metrics", "--nproc", nproc, "trainer.mini_batches_per_step=2", "algorithm.ppo_epochs=2",
                 "algorithm.rollout_correction=mis", "algorithm.rollout_correction_low=0.9", env=_env(), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "update/actor/pg_loss" in result.stdout and "experience/rollout_is_mean" in result.stdout
    assert "rollout_corr/kl_k3" in result.stdout  # the planted behaviour log-probs: diagnosed on 1 and 2 ranks


# Bugs before the layouts (docs/check-metrics.md, "What the reference recomputes before the layouts"): every layout is
# fed the same wrong experience, so only the reference's own cut of the raw generation output, its own policy mask
# and its own rewards from the raw reward values catch them. Each passed check-metrics before the reference did so.
BEFORE_THE_LAYOUTS = {
    "plant_eos_cut_off_the_response": ("FAIL experience: prompts and responses = the cut of the raw generation",
                                       "FAIL batch/num_response_tokens [ranks="),
    "plant_eos_left_out_of_the_response_mask": ("FAIL actor/probs_ratio_min [per-sequence]",
                                                "FAIL response_length/mean [ranks="),
    "plant_reward_clipped_before_the_advantages": ("FAIL experience: rewards = the weighted raw reward values",
                                                   "FAIL reward/max [ranks="),
}


@pytest.mark.parametrize("nproc", ["1", pytest.param("2", marks=pytest.mark.slow)])  # CI: 1 (budget)
@pytest.mark.parametrize("plant", list(BEFORE_THE_LAYOUTS))
def test_a_bug_before_the_layouts_fails(cli, tmp_path, plant, nproc):
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(f"from tests.helpers.planted_bugs import {plant}\n\n{plant}()\n")
    pythonpath = os.pathsep.join([str(patch_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    result = cli("check-metrics", "--nproc", nproc, env=_env(PYTHONPATH=pythonpath), timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for line in BEFORE_THE_LAYOUTS[plant]:
        assert line in result.stdout, (line, result.stdout)
