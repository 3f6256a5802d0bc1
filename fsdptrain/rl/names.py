"""The names users choose the numerics by, defined once. Torch-free, so the config validates them in the CLI process
before any rank (or torch) starts."""

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
"""Loss aggregation modes (docs/loss.md)."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Estimators of KL(pi || pi_ref) from log-ratios (docs/loss.md)."""

ADV_ESTIMATORS = ("gae", "grpo", "rloo")
"""Advantage estimators (docs/loss.md)."""
