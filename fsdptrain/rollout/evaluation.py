"""Evaluation of a prompt source on its evaluation rows, single- and multi-turn alike (docs/evaluation.md): the
greedy mean reward (``eval/reward``) and the sampled evaluation (``eval/pass@k``, ``eval/mean@n``, ``eval/maj@n``).
Both sample through the source's own sampler and score through its own scoring, so a multi-turn run is evaluated on
trajectories that run its tools, and reward models score evaluation samples as they score training ones.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from omegaconf import DictConfig

from fsdptrain.data.prompts import PromptRow
from fsdptrain.distributed import world
from fsdptrain.rewards.builtin import comparable_answers
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.rewards.runner import RewardBatch, RewardScores
from fsdptrain.rl.eval_metrics import sampled_eval_metrics
from fsdptrain.metrics.typed import Metrics
from fsdptrain.rollout.sampler import Samples

SampleAndScore = Callable[..., tuple[Samples, RewardBatch, RewardScores, Metrics]]
"""``PromptSource.sample_and_score``: ``(mine, *, repeat, mode, step, round_index, rank) -> (samples, batch, scores,
model metrics)``, the models and the device bound."""


def _mine(rows: Sequence[PromptRow], *, rank: int, world_size: int) -> list[tuple[int, PromptRow]]:
    """This rank's evaluation rows: row i on rank i % world_size."""
    return [(i, row) for i, row in enumerate(rows) if i % world_size == rank]


@torch.no_grad()
def greedy_reward(sample_and_score: SampleAndScore, eval_rows: Sequence[PromptRow], *, rank: int,
                  world_size: int) -> float:
    """Greedy mean reward (the weighted total) over the evaluation rows, the same every time, over all ranks."""
    mine = _mine(eval_rows, rank=rank, world_size=world_size)
    _, _, scores, _ = sample_and_score(mine, repeat=1, mode="greedy", step=-1, round_index=0, rank=rank)
    sums = world.all_reduce_sum(torch.tensor([sum(scores.total), float(len(mine))], dtype=torch.float64))
    return float(sums[0] / sums[1])


@torch.no_grad()
def sampled_eval(sample_and_score: SampleAndScore, eval_rows: Sequence[PromptRow],
                 functions: Sequence[RewardFunction], *, num_reward_models: int, trainer: DictConfig, step: int,
                 rank: int, world_size: int) -> Metrics:
    """This rank's share of ``eval/pass@k``, ``eval/mean@n`` and ``eval/maj@n`` (`sampled_eval_metrics`; MEANs to be
    reduced over ranks): ``trainer.eval_n`` samples of each of its evaluation rows (row i on rank i % world_size),
    sample s of row i drawn with its own generator seeded by (seed, step, i, s) (and the turn, multi-turn).
    Collective (generation, the reward functions' agreed failure flag). maj@n compares the samples' final answers
    when every reward is a built-in that scores the final answer (`comparable_answers`); else it is absent."""
    n = trainer.eval_n
    mine = _mine(eval_rows, rank=rank, world_size=world_size)
    samples, _, scores, _ = sample_and_score(mine, repeat=n, mode="eval", step=step, round_index=0, rank=rank)
    rewards_PN = [scores.total[p * n:(p + 1) * n] for p in range(len(mine))]
    answers = comparable_answers(samples.answers, [f.spec for f in functions], num_reward_models=num_reward_models)
    answers_PN = None if answers is None else [answers[p * n:(p + 1) * n] for p in range(len(mine))]
    return sampled_eval_metrics(rewards_PN, answers_PN, n=n, ks=list(trainer.eval_k),
                                threshold=trainer.eval_correct_threshold)
