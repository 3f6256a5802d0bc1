"""Sharded reward models over 2 gloo ranks == the plain model in one process (workers/reward_model_checks.py).

One launch: each rank scores its share of the sequences (uneven: 4 and 1, so rank 1 runs an empty pack) with the
reward model sharded over both ranks, with and without CPU offload; the all-gathered scores must equal each sequence
scored alone by the plain model. Also the critic started from a reward model, and a mismatch raised on both ranks.
"""

from __future__ import annotations

import pytest

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from tests.dist.launch import launch
from tests.helpers.reward_model_folders import save_policy_shaped_reward_model, save_reward_model

TOL = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    models = tmp_path_factory.mktemp("reward_models")
    save_reward_model(models / "llama", arch="llama", seed=1)
    save_reward_model(models / "qwen2", arch="qwen2", seed=2)
    save_reward_model(models / "qwen2_bundled", arch="qwen2", tokenizer=load_bundled_tokenizer(), seed=3)
    save_policy_shaped_reward_model(models / "policy_shaped", seed=4)
    out = tmp_path_factory.mktemp("out")
    result = launch("reward_model_checks.py", nproc=2, out_dir=out, args=("--models", str(models)))
    return result.checked(2).results


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", ["sharded", "offload"])
def test_two_ranks_score_like_one_process(two_ranks, arch, variant):
    for rank, result in two_ranks.items():
        got, plain = result[arch][variant], result[arch]["plain"]
        assert max(abs(a - b) for a, b in zip(got["scores"], plain)) <= TOL, (rank, got["scores"], plain)
        assert got["frozen"] and not got["training"]
        assert got["num_packs"] == 2  # agreed: the rank with one sequence ran an empty pack too


def test_the_sharded_critic_starts_at_the_reward_models_scores(two_ranks):
    for result in two_ranks.values():
        critic = result["critic"]
        assert max(abs(a - b) for a, b in zip(critic["values"], critic["plain"])) <= TOL, critic


def test_an_architecture_mismatch_is_one_config_error_on_every_rank(two_ranks):
    for result in two_ranks.values():
        assert "Qwen2ForSequenceClassification" in (result["mismatch_error"] or ""), result["mismatch_error"]
