"""``fsdptrain check-reward`` builds only what sampling and scoring read: the policy and the reward models, never
the critic (the default ``algorithm=ppo`` has one), the KL reference or an optimizer (workers/check_reward_models.py
counts what the process holds while the policy generates, with torch's global forward pre-hook)."""

from __future__ import annotations

from tests.dist.launch import run_single
from tests.helpers.reward_model_folders import save_reward_model


def test_check_reward_holds_the_policy_and_the_reward_models_only(tmp_path):
    folder = save_reward_model(tmp_path / "rm", seed=3)
    overrides = ("algorithm.use_kl_loss=true", f"reward.models=[{folder}]", "rollout.prompts_per_step=2",
                 "rollout.n=2")
    result = run_single("check_reward_models.py", out_dir=tmp_path / "out", args=("--overrides", *overrides))
    record = result.checked(1).results[0]
    assert record["code"] in (0, 1), result.describe()  # 1: nothing to learn, which is a finding, not a failure
    assert record["models"] == {"LlamaForCausalLM": 1, "LlamaForSequenceClassification": 1}, record
    assert record["optimizers"] == 0, record
