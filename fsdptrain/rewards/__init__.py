"""Reward functions: the built-ins, loading users' functions by name, running them (optionally in worker processes).

Kept torch-free on import: worker processes import this package to run the functions. The metrics helper, which
needs torch, lives in :mod:`fsdptrain.rewards.reward_metrics` and is imported from there.
"""

from fsdptrain.rewards.builtin import BUILTINS, exact_match, final_answer, math_reward, think_format, word_match

__all__ = ["BUILTINS", "exact_match", "final_answer", "math_reward", "think_format", "word_match"]
