"""verl's ActorConfig, as far as the policy loss reads it (clip ratios, dual-clip bound)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    rollout_n: int = 1
    ppo_micro_batch_size: Optional[int] = None
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
