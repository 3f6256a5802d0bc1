"""verl.trainer.ppo.mismatch_helper (verl's name for rollout correction before `rollout_corr_helper`), translated to
fsdptrain through the rollout_corr_helper shim; metrics carry verl's older "mismatch" names.

verl argument -> fsdptrain: rollout_is_mode="truncate" -> weights capped at the threshold (mode "tis");
rollout_is_mode="mask" -> the same weights and a rejection at the IS level over [lower, threshold]
(`rollout_rejection_mask`); rollout_is_veto_threshold -> `rollout_veto_mask`.
"""

from __future__ import annotations

from verl.trainer.ppo.rollout_corr_helper import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
)


def compute_mismatch_metrics(old_log_prob, rollout_log_prob, response_mask):
    return {f"mismatch_{k}": v for k, v in compute_offpolicy_metrics(old_log_prob, rollout_log_prob,
                                                                     response_mask).items()}


def compute_rollout_importance_weights(old_log_prob, rollout_log_prob, response_mask, rollout_is_level="token",
                                       rollout_is_mode="truncate", rollout_is_threshold=None,
                                       rollout_is_threshold_lower=None, rollout_is_veto_threshold=None, **_):
    if rollout_is_threshold is None:
        return None, response_mask, {}
    masking = rollout_is_mode == "mask"
    proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob, rollout_log_prob, response_mask,
        rollout_is=rollout_is_level, rollout_is_threshold=rollout_is_threshold,
        rollout_rs=rollout_is_level if masking else None, rollout_rs_threshold=rollout_is_threshold,
        rollout_rs_threshold_lower=rollout_is_threshold_lower, rollout_token_veto_threshold=rollout_is_veto_threshold)
    renamed = {}
    for key, value in metrics.items():
        name = key.removeprefix("rollout_corr/")
        if name.startswith("rollout_rs_"):
            name = "rollout_is_" + name.removeprefix("rollout_rs_")
        elif not name.startswith("rollout_is_"):
            name = "mismatch_" + name
        renamed[f"mismatch/{name}"] = value
    return proto, mask, renamed
