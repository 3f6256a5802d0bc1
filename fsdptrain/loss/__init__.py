"""Loss numerics: aggregation, policy and value losses, the gradient-scale report. Pure torch, no torch.distributed."""

from fsdptrain.loss.aggregate import (
    AGG_MODES,
    LossNormalizers,
    SeqLayout,
    agg_loss,
    agg_loss_with,
    check_mode,
    count_tokens_and_seqs,
)
from fsdptrain.loss.grad_scale import GradScaleReport, grad_scale_report
from fsdptrain.loss.policy import KL_ESTIMATORS, entropy_from_logits, kl_penalty, policy_loss
from fsdptrain.loss.value import value_loss

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "GradScaleReport",
    "LossNormalizers",
    "SeqLayout",
    "agg_loss",
    "agg_loss_with",
    "check_mode",
    "count_tokens_and_seqs",
    "entropy_from_logits",
    "grad_scale_report",
    "kl_penalty",
    "policy_loss",
    "value_loss",
]
