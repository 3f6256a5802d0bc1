"""verl's RolloutCorrectionConfig: the fields verl's tests set, and the preset they read. In fsdptrain the same
choices are `algorithm.rollout_correction*` and `algorithm.rollout_rejection*` (docs/off-policy.md); this holder
only carries verl's spellings to the rollout_corr_helper shim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = "sequence"
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[str, float]] = None

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        """verl's preset: sequence-level truncated IS and a rejection by the geometric mean ratio (seq_mean_k1)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)
