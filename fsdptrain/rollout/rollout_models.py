"""What rollouts read of the run's models (:class:`RolloutModels`): the policy that samples, and the reward models
that score. ``fsdptrain.train.setup.Models`` satisfies it; nothing in ``rollout/`` imports the recipes."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class RolloutModels(Protocol):
    """The policy (possibly FSDP2-sharded; the decoder's block gathers it) and the reward models with their specs,
    one spec per model (``fsdptrain.model.reward_model.RewardModelSpec``)."""

    policy: torch.nn.Module
    reward_models: Sequence[torch.nn.Module]
    reward_specs: Sequence
