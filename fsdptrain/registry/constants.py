"""Numeric bounds that are both a numerics constant and (for some) a config default, defined once.

Torch-free: the config's schema takes its defaults from here in the CLI's parent process.
"""

LOG_RATIO_CLAMP = 20.0
"""Bound on every log-ratio before `exp` (importance ratios, k3's `exp(-d)`, rollout-correction weights): the
log-ratio is clamped to [-20, 20], so a ratio stays within exp(+-20) and never overflows float32 (docs/loss.md)."""

KL_CLAMP = 10.0
"""Default bound on the value of the k3 and k3+ KL estimators (`algorithm.kl_clamp`; verl's 10 for "low_var_kl"):
the value is clamped to [-10, 10], with zero gradient outside (docs/algorithms.md)."""
