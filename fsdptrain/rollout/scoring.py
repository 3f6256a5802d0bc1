"""Learned reward models in the experience path: score this rank's samples, scale, combine (docs/reward-models.md).

Legend: `_N` one value per sample of this rank.

After generation every rank re-tokenises its (prompt, completion) texts with each reward model's own tokenizer and
chat template, packs them with the agreed plan (``plan_agreed``: every rank runs the same number of forwards, so the
sharded model's collectives line up) and reads each score at its sequence's own last token. Every unit is
resharded after each model's phase (`reshard_all`). The scores' (sum, sum of squares, count) of every model go into
ONE all-reduce, so ``batch`` and ``running`` normalisation use the global batch's moments at any world size; the
running moments are the caller's state (kept across steps and in checkpoints). The models' weighted, scaled scores
are returned for the caller to add to the reward functions' weighted total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import reshard_all
from fsdptrain.model.reward_model import reward_input_ids, score_sequences
from fsdptrain.metrics.typed import Metrics, merge_all
from fsdptrain.rl.reward_scale import RunningMoments, combine, scale_scores, score_metrics, score_moments
from fsdptrain.distributed.collectives import plan_agreed


@dataclass(frozen=True)
class ModelScores:
    """``total_N``: sum_m weight_m x scaled_m per sample; ``scaled_N[m]`` / ``raw_N[m]`` per model; ``running``: the
    running moments after this batch (unchanged unless the mode is running); ``metrics``: per model, typed."""

    total_N: Tensor
    raw_N: list[Tensor]
    scaled_N: list[Tensor]
    running: list[RunningMoments]
    metrics: Metrics


@torch.no_grad()
def score_with_reward_models(
    models: Sequence[torch.nn.Module],
    specs: Sequence,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    weights: Sequence[float],
    mode: str,
    clip: float | None,
    running: Sequence[RunningMoments],
    token_budget: int,
    device: torch.device,
    conversations: Optional[Sequence[list[dict]]] = None,
) -> ModelScores:
    """Score, normalise, clip and combine this rank's samples with every reward model (collective).

    ``conversations`` (multi-turn: one list of messages per sample, the prompt's and the turns') are what a reward
    model with a chat template reads instead of the prompt and completion texts (`reward_input_ids`).

    Metrics are named ``reward_model/<m>/raw/...`` and ``reward_model/<m>/scaled/...`` with ``m`` the model's index in
    ``reward.models``; they reduce exactly over ranks (``score_metrics``).
    """
    raw_N = []
    for model, spec in zip(models, specs):
        messages = conversations if conversations is not None else [None] * len(prompts)
        input_ids = [reward_input_ids(spec, p, c, messages=m) for p, c, m in zip(prompts, completions, messages)]
        plan = plan_agreed([len(ids) for ids in input_ids], token_budget)
        raw_N.append(score_sequences(model, input_ids, plan.packs, device=device).to(torch.float64))
        reshard_all(model)  # the root (and layers with parallel.reshard_after_forward=false) stay unsharded otherwise
    local = torch.cat([score_moments(scores) for scores in raw_N])
    global_moments = world.all_reduce_sum(local).reshape(len(raw_N), 3)
    scaled_N, new_running, metrics = [], [], []
    for m, scores in enumerate(raw_N):
        scaled, state = scale_scores(scores, mode=mode, global_moments=global_moments[m], running=running[m], clip=clip)
        scaled_N.append(scaled)
        new_running.append(state)
        metrics.append(score_metrics(scores, scaled, prefix=f"reward_model/{m}/"))
    total_N = combine(scaled_N, list(weights))
    return ModelScores(total_N=total_N, raw_N=raw_N, scaled_N=scaled_N, running=new_running,
                       metrics=merge_all(metrics))
