"""The names users choose from in the config, defined once, with no torch import.

`fsdptrain.config` validates choices against these tuples in the CLI's parent process, before any rank (or torch)
starts, and the numerics' registries (`fsdptrain.rl`) are keyed by the same tuples (tests/unit/test_names.py holds them
equal).
"""

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
"""`loss.agg_mode`: how per-token losses become one mini-batch scalar (docs/loss.md)."""

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "mse", "k1+", "k3+", "abs+")
"""`algorithm.kl_estimator`: per-token estimators of KL(pi || pi_ref) (docs/algorithms.md)."""

POLICY_LOSSES = ("vanilla", "cispo", "gmpo", "dro")
"""`algorithm.policy_loss`: the built-in policy-gradient terms; a `module:function` or `file.py:function` names a
user's own (docs/algorithms.md)."""

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""`algorithm.adv_estimator`: the built-in advantage estimators; a `module:function` or `file.py:function` names a
user's own (docs/algorithms.md)."""

ROLLOUT_CORRECTION_MODES = ("tis", "mis")
"""Off-policy correction: truncated (tis) or masked (mis) importance sampling (docs/off-policy.md)."""

DRAFT_ON = ("response", "all")
"""`drafter.on`: the positions the drafter trains on, the response tokens only or every token (docs/drafter.md)."""

ROLLOUT_CORRECTION_LEVELS = ("token", "sequence", "geometric")
"""Off-policy correction: one weight per token, or one per sequence from the product (sequence) or the geometric mean
(geometric, verl's older `rollout_is_level="geometric"`) of its token ratios."""

ROLLOUT_REJECTION_LEVELS = ("token", "sequence", "geometric")
"""`algorithm.rollout_rejection`: reject tokens by their own ratio, or whole sequences by the product or the geometric
mean of their token ratios (docs/off-policy.md)."""

ROLLOUT_DIVERGENCE_REJECTIONS = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                                 "seq_max_k2", "seq_max_k3")
"""`algorithm.rollout_rejection_divergence`: verl's `rollout_rs` divergence options, a bound on the k2 or k3 estimate
of the old/behaviour divergence per token, or on its sum, mean or max over a sequence (docs/off-policy.md)."""

ADV_ESTIMATOR_ARGS = ("token_rewards_BT", "values_BT", "mask_BT", "scores_N", "group_ids_N", "settings")
"""The keyword names an advantage estimator must accept (checked when a user's function is loaded)."""

POLICY_LOSS_ARGS = ("logprobs", "old_logprobs", "advantages", "valid", "layout", "settings")
"""The keyword names a policy-loss function must accept (checked when a user's function is loaded)."""

USER_FUNCTION_FIELDS = {"algorithm.adv_estimator": ADV_ESTIMATOR_ARGS, "algorithm.policy_loss": POLICY_LOSS_ARGS}
"""Config fields that may name a user's function, and the keywords it must accept: the CLI loads and checks them in
the parent process, so a bad one is exit 2 before any rank starts."""
