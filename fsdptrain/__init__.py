"""fsdptrain: RL post-training for causal LMs on PyTorch FSDP2 with packed sequences."""

from fsdptrain.registry.plugins import register_adv_estimator, register_policy_loss

__version__ = "0.1.0"
__all__ = ["register_adv_estimator", "register_policy_loss"]
