"""The numerics of RL post-training: loss aggregation, policy and value losses, log-probs, advantages, metrics.

Pure torch. Nothing here imports torch.distributed, a model or the training loop: global counts and moments arrive as
arguments (docs/architecture.md).
"""
