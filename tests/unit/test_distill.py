"""On-policy distillation's advantage and metrics against hand computations; its config rules; the vocabulary check."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.model.checks import vocabulary_mismatch
from fsdptrain.rl.distill import DistillSettings, distill_advantages, distill_metrics
from fsdptrain.metrics.typed import finalize, merge
from fsdptrain.train.setup import skips_old_passes
from fsdptrain.train.experience import distilled

STUDENT = [[-1.0, -2.0, -0.5], [-0.25, -3.0, 0.0]]
TEACHER = [[-1.5, -1.0, -0.5], [-2.25, -1.0, 0.0]]
MASK = [[True, False, True], [True, True, False]]  # row 1: a tool token; row 2: a pad position
TASK = [[0.3, 0.3, 0.3], [-0.7, -0.7, -0.7]]
# kl = student - teacher on the policy tokens: row 1 [0.5, -, 0.0], row 2 [2.0, -2.0, -]


def test_the_advantage_is_minus_coef_times_the_reverse_kl_and_zero_off_the_policy_tokens():
    adv = distill_advantages(torch.tensor(TASK), torch.tensor(STUDENT), torch.tensor(TEACHER), torch.tensor(MASK),
                             coef=0.5, add_task=False)
    assert adv.dtype == torch.float32
    assert adv.tolist() == [[-0.25, 0.0, 0.0], [-1.0, 1.0, 0.0]]


def test_with_the_task_reward_its_advantage_is_added_unscaled():
    adv = distill_advantages(torch.tensor(TASK), torch.tensor(STUDENT), torch.tensor(TEACHER), torch.tensor(MASK),
                             coef=0.5, add_task=True)
    torch.testing.assert_close(adv, torch.tensor([[0.05, 0.0, 0.3], [-1.7, 0.3, 0.0]]), rtol=0, atol=1e-7)


def test_the_metrics_pool_every_policy_token_whatever_the_split():
    student, teacher, mask = torch.tensor(STUDENT), torch.tensor(TEACHER), torch.tensor(MASK)
    whole = finalize(distill_metrics(student, teacher, mask))
    # four policy tokens: kl 0.5, 0.0, 2.0, -2.0; teacher -1.5, -0.5, -2.25, -1.0
    assert whole == pytest.approx({"distill/reverse_kl_mean": 0.125, "distill/reverse_kl_max": 2.0,
                                   "distill/teacher_logprob_mean": -1.3125}, abs=1e-12)
    halves = merge(distill_metrics(student[:1], teacher[:1], mask[:1]),
                   distill_metrics(student[1:], teacher[1:], mask[1:]))
    assert finalize(halves) == pytest.approx(whole, abs=1e-12)  # not the mean of the halves' means (0.25, 0.0)


def test_no_policy_token_leaves_the_metrics_absent_not_zero():
    empty = torch.zeros(1, 0)
    assert finalize(distill_metrics(empty, empty, torch.zeros(1, 0, dtype=torch.bool))) == {}


def test_the_experience_pass_applies_it_per_sequence_over_the_policy_tokens():
    student = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.25, -3.0])]
    teacher = [torch.tensor([-1.5, -1.0, -0.5]), torch.tensor([-2.25, -1.0])]
    masks = [torch.tensor([True, False, True]), None]
    adv, metrics = distilled([torch.zeros(3), torch.zeros(2)], student, teacher, masks,
                             DistillSettings(coef=2.0, add_task=False))
    assert [a.tolist() for a in adv] == [[-1.0, 0.0, 0.0], [-4.0, 4.0]]
    assert finalize(metrics)["distill/reverse_kl_mean"] == pytest.approx(0.125, abs=1e-12)


def test_distillation_refuses_a_critic_and_needs_no_old_pass_skipping():
    with pytest.raises(ConfigError, match="with no value model; set algorithm=grpo"):
        compose_config(["algorithm.distill.teacher=/some/teacher"])
    with pytest.raises(ConfigError, match="task_reward=add needs a teacher"):
        compose_config(["algorithm=grpo", "algorithm.distill.task_reward=add"])
    with pytest.raises(ConfigError, match="algorithm.distill.task_reward='both' is not a valid choice"):
        compose_config(["algorithm=grpo", "algorithm.distill.task_reward=both"])
    cfg = compose_config(["algorithm=grpo", "algorithm.distill.teacher=/some/teacher"])
    assert skips_old_passes(compose_config(["algorithm=grpo"]))
    assert not skips_old_passes(cfg)  # the reverse KL reads the old (student) log-probs before the update


def _word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({w: i for i, w in enumerate(words)},
                                                                        unk_token=words[0])))


def test_a_teacher_vocabulary_must_be_the_students():
    student = _word_tokenizer(["<unk>", "a", "b", "c"])
    assert vocabulary_mismatch(student, _word_tokenizer(["<unk>", "a", "b", "c"])) is None
    assert vocabulary_mismatch(student, _word_tokenizer(["<unk>", "a", "b"])) == (
        "the teacher's tokenizer has 3 tokens and the student's 4")
    assert vocabulary_mismatch(student, _word_tokenizer(["<unk>", "a", "c", "b"])) == (
        "token id 2 is 'b' to the student and 'c' to the teacher (both have 4 tokens)")
