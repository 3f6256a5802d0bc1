"""Evaluation with n samples (docs/evaluation.md): pass@k, majority vote, the answers compared, the per-sample
seeds and sampler, and the config's bounds, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.rewards.builtin import comparable_answers
from fsdptrain.rl.eval_metrics import majority_index, pass_at_k, sampled_eval_metrics
from fsdptrain.metrics.typed import Kind, finalize, merge_all


@pytest.mark.parametrize(("n", "c", "k", "want"), [
    (5, 2, 1, 0.4),                         # c / n
    (5, 2, 2, 1 - 3 / 10),                  # 1 - C(3, 2) / C(5, 2) = 0.7
    (5, 2, 4, 1.0),                         # n - c = 3 < k: every 4-subset holds a correct sample
    (5, 0, 3, 0.0),
    (4, 1, 2, 1 - 3 / 6),                   # 1 - C(3, 2) / C(4, 2) = 0.5
    (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),  # 1 - 21/252
])
def test_pass_at_k_by_hand(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)


def test_pass_at_k_is_the_mean_over_every_k_subset_and_stays_finite_for_large_n():
    from itertools import combinations

    correct = [1, 0, 0, 1, 0, 1, 0]  # n = 7, c = 3, k = 3: the share of 3-subsets holding a 1
    subsets = list(combinations(correct, 3))
    assert pass_at_k(7, 3, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-15)
    # C(2000, 1000) overflows a float; the product form does not: 1 - C(1999, 1000) / C(2000, 1000) = 1000/2000
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)


def test_pass_at_k_refuses_k_outside_1_to_n():
    with pytest.raises(ValueError, match="1 <= k <= n, got k=6 with n=5"):
        pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(5, 2, 0)


def test_majority_index_takes_the_most_frequent_answer_and_the_first_on_a_tie():
    assert majority_index(["7", "3", "3", "7", "3"]) == 1  # "3" three times
    assert majority_index(["a", "b", "b", "a"]) == 0       # a tie: the answer seen first
    assert majority_index([""]) == 0


def test_sampled_eval_metrics_by_hand_and_split_over_ranks():
    """Two prompts, n = 4, threshold 1. Prompt 0: rewards [1, 0, 1, 0.5], answers [x, y, x, z]: c = 2, majority x
    (correct). Prompt 1: rewards [0, 0, 1, 0], answers [u, u, v, w]: c = 1, majority u (wrong).
    pass@1 = (2/4 + 1/4) / 2 = 3/8; pass@2 = ((1 - C(2,2)/C(4,2)) + (1 - C(3,2)/C(4,2))) / 2 = (5/6 + 1/2) / 2 = 2/3;
    pass@4 = 1; mean@4 = (2.5 + 1) / 8; maj@4 = (1 + 0) / 2."""
    rewards = [[1.0, 0.0, 1.0, 0.5], [0.0, 0.0, 1.0, 0.0]]
    answers = [["x", "y", "x", "z"], ["u", "u", "v", "w"]]
    want = {"eval/pass@1": 3 / 8, "eval/pass@2": 2 / 3, "eval/pass@4": 1.0, "eval/mean@4": 3.5 / 8, "eval/maj@4": 0.5}
    metrics = sampled_eval_metrics(rewards, answers, n=4, ks=[1, 2, 4], threshold=1.0)
    assert finalize(metrics) == pytest.approx(want, abs=1e-15)
    assert {m.kind for m in metrics.values()} == {Kind.MEAN}
    # prompt 0 on one rank, prompt 1 on the other: the pooled totals and counts give the same numbers
    split = merge_all([sampled_eval_metrics(rewards[:1], answers[:1], n=4, ks=[1, 2, 4], threshold=1.0),
                       sampled_eval_metrics(rewards[1:], answers[1:], n=4, ks=[1, 2, 4], threshold=1.0)])
    assert finalize(split) == pytest.approx(want, abs=1e-15)
    # answers that cannot be compared: maj@n is absent, never 0.0
    assert "eval/maj@4" not in finalize(sampled_eval_metrics(rewards, None, n=4, ks=[1], threshold=1.0))


def test_answers_compared_for_the_answer_rewards_only():
    completions = ["<think>hm</think> 42 ", "<think>no</think>42", "4  2"]
    # exact_match and math read the final answer: the first two vote alike
    assert comparable_answers(completions, ["exact_match"], num_reward_models=0) == ["42", "42", "4  2"]
    # word_match reads the words of the whole completion
    assert comparable_answers(completions, ["word_match"], num_reward_models=0)[2] == "4 2"
    assert comparable_answers(completions, ["exact_match", "think_format"], num_reward_models=0) is None
    assert comparable_answers(completions, ["my_rewards.py:score"], num_reward_models=0) is None
    assert comparable_answers(completions, ["exact_match"], num_reward_models=1) is None


def test_eval_sample_seeds_depend_on_the_step_prompt_and_sample_only():
    from fsdptrain.generation.block import eval_sample_seed

    seeds = {eval_sample_seed(1234, step, prompt, sample) for step in range(3) for prompt in range(5)
             for sample in range(4)}
    assert len(seeds) == 60
    assert eval_sample_seed(1234, 2, 3, 1) == eval_sample_seed(1234, 2, 3, 1)


def test_row_seeded_sampling_draws_each_row_from_its_own_generator():
    """The processor's output for a row is log_softmax(z / T) + Gumbel noise from that row's generator alone: the
    same row in another batch, next to other rows, gets the same scores; the global RNG is untouched."""
    from fsdptrain.generation.generate import RowSeededSampling

    z = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, -1.0]])
    state = torch.get_rng_state()
    pair = RowSeededSampling([11, 22], temperature=0.5, device=torch.device("cpu"))(None, z)
    alone = RowSeededSampling([22], temperature=0.5, device=torch.device("cpu"))(None, z[1:])
    assert torch.equal(pair[1:], alone)
    u = torch.rand(3, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    want = torch.log_softmax(z[0] / 0.5, dim=-1) + (-torch.log(-torch.log(u))).float()
    torch.testing.assert_close(pair[0], want, rtol=0, atol=1e-6)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.eval_n=4", "trainer.eval_k=[1,5]"],
     "trainer.eval_k: pass@5 needs at least 5 samples per prompt, but trainer.eval_n=4: each k must be in "
     "[1, eval_n]"),
    (["trainer.eval_n=4", "trainer.eval_k=[0]"], "trainer.eval_k: 0 must be an integer >= 1"),
    (["trainer.eval_n=0"], "trainer.eval_n=0 must be a positive integer"),
    (["trainer.eval_temperature=0"], "trainer.eval_temperature=0.0 must be a finite number > 0"),
])
def test_eval_fields_are_checked(overrides, message):
    with pytest.raises(ConfigError) as excinfo:
        compose_config(overrides)
    assert message in str(excinfo.value)
