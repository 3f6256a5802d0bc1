"""fsdptrain: RL post-training for causal LMs on PyTorch FSDP2 with packed sequences."""

__version__ = "0.1.0"
