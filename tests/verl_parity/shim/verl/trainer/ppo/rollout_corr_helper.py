"""verl.trainer.ppo.rollout_corr_helper, translated to fsdptrain.fsdptrain.rl.rollout_correction.

verl argument / metric -> fsdptrain:
    rollout_is="token"|"sequence", rollout_is_threshold=C -> rollout_correction_weights(mode="tis", level, cap=C)
    rollout_rs="token"|"sequence"|"geometric", rollout_rs_threshold=H, rollout_rs_threshold_lower=L
        -> rollout_rejection_mask(level, low=L, high=H); fsdptrain has no default for L: verl's default 1/H is
        passed explicitly here
    verl's newer "token_k1"|"seq_sum_k1"|"seq_mean_k1" with "L_H" bound -log r to [ln L, ln H], that is the ratio r
        to [1/H, 1/L] -> rollout_rejection_mask(token|sequence|geometric, low=1/H, high=1/L)
    "token_k2"|"token_k3"|"seq_{sum,mean,max}_k{2,3}" with an upper H
        -> algorithm.rollout_rejection_divergence=<the same name>, algorithm.rollout_rejection_divergence_max=H
    one ratio option and one divergence option at most go through fsdptrain's config (composed and validated, then
        the experience pass's rejection_settings and rollout_rejection); longer chains, one function each in turn
    rollout_token_veto_threshold=T -> rollout_veto_mask(threshold=T)
    metrics: kl_k1 -> kl, kl_k3 -> k3_kl, rollout_rs_rejected_token_frac -> rollout_rs_masked_fraction,
        rollout_rs_ratio_mean -> rollout_rs_mean, rollout_veto_seq_frac -> rollout_is_veto_fraction,
        rollout_veto_token_frac -> rollout_is_catastrophic_token_fraction,
        rollout_rs_<k2/k3 option>_mean -> rollout_rs_divergence_mean; every other name is fsdptrain's own.
    Not mapped, because fsdptrain logs a different quantity (tests/verl_parity/README.md): verl's
        rollout_rs_<k1 option>_mean (the mean of -log r; fsdptrain logs rollout_rs_ratio_mean, the mean of r) and
        verl's rollout_rs_seq_masked_fraction (fsdptrain's rollout_rs_rejected_seq_frac is the share of sequences
        left with no valid token, a different count). A verl test asserting them fails with a KeyError.
"""

from __future__ import annotations

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.metrics.typed import finalize
from fsdptrain.rl.rollout_correction import (
    off_policy_diagnostics,
    rollout_correction_weights,
    rollout_divergence_rejection_mask,
    rollout_rejection,
    rollout_rejection_mask,
    rollout_veto_mask,
    sequence_perplexity,
)
from fsdptrain.train.experience import rejection_settings
from verl.protocol import DataProto

VERL_NAMES = {
    "kl_k1": "kl",
    "kl_k3": "k3_kl",
    "rollout_rs_rejected_token_frac": "rollout_rs_masked_fraction",
    "rollout_rs_ratio_mean": "rollout_rs_mean",
    "rollout_veto_seq_frac": "rollout_is_veto_fraction",
    "rollout_veto_token_frac": "rollout_is_catastrophic_token_fraction",
}
RS_LEVELS = {"token": "token", "sequence": "sequence", "geometric": "geometric"}
K1_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
DIVERGENCES = {f"{prefix}_{k}": (k, reduction) for k in ("k2", "k3")
               for prefix, reduction in (("token", "token"), ("seq_sum", "sum"), ("seq_mean", "mean"),
                                         ("seq_max", "max"))}
SUPPORTED_ROLLOUT_RS_OPTIONS = (*RS_LEVELS, *K1_LEVELS, *DIVERGENCES)


def _verl(metrics) -> dict[str, float]:
    return {VERL_NAMES.get(k, k): v for k, v in finalize(metrics).items()}


def _bounds(threshold, lower):
    """verl's threshold forms: a number H (lower L or 1/H), or the string "L_H"."""
    if isinstance(threshold, str) and "_" in threshold:
        low, high = (float(x) for x in threshold.split("_"))
        return low, high
    high = float(threshold)
    return (float(lower) if lower is not None else 1.0 / high), high


def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    if rollout_log_prob is None:
        return _verl(sequence_perplexity(old_log_prob, response_mask).prefixed("training_"))
    return _verl(off_policy_diagnostics(old_log_prob, rollout_log_prob, response_mask))


def _config_overrides(options: list[str], thresholds: list, lower) -> list[str]:
    """verl's rollout_rs options as fsdptrain's config: one ratio option -> algorithm.rollout_rejection (k1 bounds
    on -log r turned into ratio bounds), one divergence option -> algorithm.rollout_rejection_divergence."""
    overrides = []
    for option, th in zip(options, thresholds, strict=True):
        if option in DIVERGENCES:
            overrides += [f"algorithm.rollout_rejection_divergence={option}",
                          f"algorithm.rollout_rejection_divergence_max={float(th)!r}"]
            continue
        low, high = _bounds(th, lower)
        level, low, high = ((K1_LEVELS[option], 1.0 / high, 1.0 / low) if option in K1_LEVELS
                            else (RS_LEVELS[option], low, high))
        overrides += [f"algorithm.rollout_rejection={level}", f"algorithm.rollout_rejection_low={low!r}",
                      f"algorithm.rollout_rejection_high={high!r}"]
    return overrides


def _through_config(old, rollout, mask, options, thresholds, lower):
    """At most one ratio and one divergence option: composed and validated as fsdptrain's config, then the
    experience pass's own `rejection_settings` and `rollout_rejection` (each option judged on the same tokens, a
    token kept iff both keep it, as verl's chain). A setting fsdptrain's config refuses is verl's ValueError."""
    try:
        cfg = compose_config(_config_overrides(options, thresholds, lower))
    except ConfigError as error:
        raise ValueError(str(error)) from error
    keep, found = rollout_rejection(old, rollout, mask, rejection_settings(cfg.algorithm))
    values = finalize(found)
    metrics = _verl(found)
    for option in options:
        if option in DIVERGENCES:
            metrics[f"rollout_rs_{option}_mean"] = values["rollout_rs_divergence_mean"]
    return keep.to(mask.dtype), metrics


def _rejections(old, rollout, mask, rollout_rs, threshold, lower):
    """verl's comma-separated rollout_rs options: through fsdptrain's config when they are one ratio and one
    divergence option at most, else one fsdptrain rejection function each, applied in turn."""
    metrics: dict[str, float] = {}
    options = rollout_rs.split(",")
    thresholds = str(threshold).split(",") if len(options) > 1 else [threshold]
    unknown = [o for o in options if o not in SUPPORTED_ROLLOUT_RS_OPTIONS]
    if unknown:
        raise ValueError(f"fsdptrain has no rejection for verl's rollout_rs={unknown[0]!r}")
    if len(thresholds) != len(options):
        raise ValueError(f"rollout_rs={rollout_rs!r} needs one threshold per option, got {threshold!r}")
    if sum(o in DIVERGENCES for o in options) <= 1 and sum(o not in DIVERGENCES for o in options) <= 1:
        return _through_config(old, rollout, mask, options, thresholds, lower)
    for option, th in zip(options, thresholds, strict=True):
        if option in DIVERGENCES:
            estimator, reduction = DIVERGENCES[option]
            keep, found = rollout_divergence_rejection_mask(old, rollout, mask, estimator=estimator,
                                                            reduction=reduction, high=float(th))
            stat = "rollout_rs_divergence_mean"
        elif option in K1_LEVELS:
            low, high = _bounds(th, lower)
            keep, found = rollout_rejection_mask(old, rollout, mask, level=K1_LEVELS[option], low=1.0 / high,
                                                 high=1.0 / low)
            stat = "rollout_rs_ratio_mean"
        elif option in RS_LEVELS:
            low, high = _bounds(th, lower)
            keep, found = rollout_rejection_mask(old, rollout, mask, level=RS_LEVELS[option], low=low, high=high)
            stat = "rollout_rs_ratio_mean"
        else:
            raise ValueError(f"fsdptrain has no rejection for verl's rollout_rs={option!r}")
        mask = keep.to(mask.dtype)
        values = finalize(found)
        metrics.update(_verl(found))
        if option in DIVERGENCES:
            metrics[f"rollout_rs_{option}_mean"] = values[stat]
    return mask, metrics


def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
                                                  rollout_is_threshold=2.0, rollout_rs=None,
                                                  rollout_rs_threshold=None, rollout_rs_threshold_lower=None,
                                                  rollout_token_veto_threshold=None, **_):
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, found = rollout_correction_weights(old_log_prob, rollout_log_prob, response_mask, mode="tis",
                                                    level=rollout_is, cap=float(rollout_is_threshold))
        weights = weights.to(old_log_prob.dtype)
        metrics.update(_verl(found))
    mask = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled")
        mask, found = _rejections(old_log_prob, rollout_log_prob, mask, rollout_rs, rollout_rs_threshold,
                                  rollout_rs_threshold_lower)
        metrics.update(found)
    if rollout_token_veto_threshold is not None:
        keep, found = rollout_veto_mask(old_log_prob, rollout_log_prob, mask, threshold=rollout_token_veto_threshold)
        mask = keep.to(response_mask.dtype)
        metrics.update(_verl(found))
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    proto = DataProto.from_dict({"rollout_is_weights": weights}) if weights is not None else None
    return proto, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
