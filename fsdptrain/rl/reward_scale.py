"""Scaling a reward model's scores: normalise (none, batch, running), then clip; and their metrics. Pure torch.

Legend: `_N` one value per sequence (this rank's), float.

Nothing here reduces across ranks. `score_moments` gives this rank's additive (sum, sum of squares, count); the loop
all-reduces them (SUM) and hands the GLOBAL moments in, so every rank normalises with the same numbers.

    none:     s' = s
    batch:    s' = (s - mean_batch) / sqrt(var_batch + eps), moments of this step's global batch
    running:  the running (count, mean, m2) first absorbs this step's global moments (the parallel-variance merge,
              exact for any split of the data), then s' = (s - mean_run) / sqrt(var_run + eps)
    then, if `clip` is set: s'' = clamp(s', -clip, clip)

Both variances are unbiased (Bessel), as advantage whitening in fsdptrain/rl/advantages.py. With fewer than 2 scores seen
the running variance is undefined and taken as 1 (the scores are only centred); batch mode needs 2 scores per step.
The running state is three floats (`RunningMoments.state_dict`) for the checkpoint's plain-data `extra`.
User-facing description: docs/reward-models.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fsdptrain.registry.errors import ConfigError
from fsdptrain.rl.advantages import mean_var, moment_stats, whiten
from fsdptrain.metrics.typed import Derived, Max, Mean, Metrics, Min, std_from_moments

NORMALIZE_MODES = ("none", "batch", "running")


def score_moments(scores_N: Tensor) -> Tensor:
    """This rank's float64 `[3]` = (sum, sum of squares, count) of its scores, for an all-reduce(SUM)."""
    return torch.stack(moment_stats(scores_N, torch.ones_like(scores_N, dtype=torch.bool)))


@dataclass(frozen=True)
class RunningMoments:
    """Moments of every score seen so far: count, mean and m2 (the sum of squared deviations from the mean)."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def merged(self, global_moments: Tensor) -> RunningMoments:
        """These moments merged with a batch's global (sum, sum of squares, count): the parallel-variance merge."""
        total, total_sq, count_b = (float(x) for x in global_moments.to(torch.float64))
        if count_b <= 0:
            return self
        mean_b = total / count_b
        m2_b = max(total_sq - count_b * mean_b * mean_b, 0.0)
        count = self.count + count_b
        delta = mean_b - self.mean
        return RunningMoments(
            count=count,
            mean=self.mean + delta * count_b / count,
            m2=self.m2 + m2_b + delta * delta * self.count * count_b / count,
        )

    def variance(self) -> float:
        return self.m2 / (self.count - 1) if self.count >= 2 else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    @staticmethod
    def from_state_dict(state: dict[str, float]) -> RunningMoments:
        return RunningMoments(count=float(state["count"]), mean=float(state["mean"]), m2=float(state["m2"]))


def scale_scores(
    scores_N: Tensor,
    *,
    mode: str,
    global_moments: Tensor,
    running: RunningMoments,
    clip: float | None,
    eps: float = 1e-8,
) -> tuple[Tensor, RunningMoments]:
    """(normalised then clipped scores `[N]`, the running moments after this batch).

    `global_moments`: the all-reduced `score_moments` of this step's batch (used by batch and running). `running`
    comes back unchanged unless mode is running. `clip`: None or a positive bound.
    """
    if mode not in NORMALIZE_MODES:
        raise ConfigError(f"reward.model_normalize={mode!r}; choose one of {', '.join(NORMALIZE_MODES)}")
    if clip is not None and not clip > 0:
        raise ConfigError(f"reward.model_clip={clip}; give a positive bound or null (no clipping)")
    valid_N = torch.ones_like(scores_N, dtype=torch.bool)
    out_N = scores_N
    if mode == "batch":
        if float(global_moments[2]) < 2:
            raise ConfigError("reward.model_normalize=batch needs at least 2 sequences per step; use running or none")
        mean, var = mean_var(*global_moments)
        out_N = whiten(scores_N, valid_N, mean=mean, var=var, eps=eps)
    elif mode == "running":
        running = running.merged(global_moments)
        out_N = whiten(scores_N, valid_N, mean=running.mean, var=running.variance(), eps=eps)
    if clip is not None:
        out_N = out_N.clamp(-clip, clip)
    return out_N, running


def score_metrics(raw_N: Tensor, scaled_N: Tensor, *, prefix: str) -> Metrics:
    """Sequence-weighted mean, std (population, exact under any split: from sum and sum of squares), min and max of
    the raw and the scaled (normalised, clipped) scores: `{prefix}raw/mean`, ... `{prefix}scaled/max`."""
    out = {}
    for name, values_N in (("raw", raw_N), ("scaled", scaled_N)):
        values_N = values_N.detach().to(torch.float64)
        valid_N = torch.ones_like(values_N, dtype=torch.bool)
        total, total_sq, count = moment_stats(values_N, valid_N)
        out[f"{prefix}{name}/mean"] = Mean(total, count)
        out[f"{prefix}{name}/std"] = Derived([total, total_sq, count], std_from_moments)
        out[f"{prefix}{name}/min"] = Min.of(values_N, valid_N)
        out[f"{prefix}{name}/max"] = Max.of(values_N, valid_N)
    return Metrics(out)


def combine(scores_per_model: list[Tensor], weights: list[float]) -> Tensor:
    """sum_m weights[m] * scores_per_model[m], `[N]`: one reward per sequence from several reward models."""
    if len(scores_per_model) != len(weights) or not scores_per_model:
        raise ConfigError(f"reward.model_weights has {len(weights)} weights for {len(scores_per_model)} reward models")
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"reward.model_weights must be finite numbers, got {weights}")
    return sum(w * s for w, s in zip(weights, scores_per_model))
