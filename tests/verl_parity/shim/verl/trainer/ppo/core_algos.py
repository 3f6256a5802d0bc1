"""verl.trainer.ppo.core_algos, translated to fsdptrain.

verl name -> fsdptrain function (names and calling conventions only; every number is fsdptrain's):
    register_adv_est / get_adv_estimator_fn -> fsdptrain.register_adv_estimator (the name check, Enum members and
        the duplicate rule are fsdptrain's); the lookup table is this module's ADV_ESTIMATOR_REGISTRY, which
        verl's tests replace and read directly
    compute_gae_advantage_return            -> fsdptrain.rl.advantages.gae
    compute_grpo_(vectorized_)outcome_advantage -> fsdptrain.rl.advantages.grpo_advantages
    compute_rloo_(vectorized_)outcome_advantage -> fsdptrain.rl.advantages.rloo_advantages
    compute_policy_loss_vanilla             -> fsdptrain.rl.policy_loss.policy_loss (vanilla pg term)
    agg_loss                                -> fsdptrain.rl.aggregate.agg_loss
"""

from __future__ import annotations

import numpy as np
import torch

import fsdptrain
from fsdptrain.registry.plugins import registration_name
from fsdptrain.rl.advantages import gae, grpo_advantages, rloo_advantages
from fsdptrain.rl.aggregate import SeqLayout, agg_loss as _fs_agg_loss, count_tokens_and_seqs
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import finalize
from fsdptrain.rl.policy_loss import policy_loss


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    return gae(token_level_rewards, values, response_mask, gamma=float(gamma), lam=float(lam))


def _group_ids(index) -> torch.Tensor:
    """verl's `index` (any hashable per row: numpy ints, uids) as fsdptrain's integer group ids."""
    ids: dict = {}
    return torch.tensor([ids.setdefault(k.item() if isinstance(k, np.generic) else k, len(ids)) for k in index])


def _scores(token_level_rewards, response_mask):
    layout = SeqLayout(token_level_rewards.shape, None, token_level_rewards.device)
    return layout.seq_sum(token_level_rewards)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    adv_N = grpo_advantages(_scores(token_level_rewards, response_mask), _group_ids(index),
                            scale_by_std=norm_adv_by_std_in_grpo, eps=epsilon)
    adv = adv_N[:, None] * response_mask
    return adv, adv


compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None):
    adv_N = rloo_advantages(_scores(token_level_rewards, response_mask), _group_ids(index))
    adv = adv_N[:, None] * response_mask
    return adv, adv


compute_rloo_vectorized_outcome_advantage = compute_rloo_outcome_advantage

ADV_ESTIMATOR_REGISTRY: dict = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
}


def register_adv_est(name_or_enum):
    fs_decorate = fsdptrain.register_adv_estimator(name_or_enum)
    name = registration_name(name_or_enum)

    def decorate(fn):
        fs_decorate(fn)
        globals()["ADV_ESTIMATOR_REGISTRY"][name] = fn
        return fn

    return decorate


def get_adv_estimator_fn(name_or_enum):
    name = registration_name(name_or_enum)
    table = globals()["ADV_ESTIMATOR_REGISTRY"]
    if name not in table:
        raise ValueError(f"Unknown advantage estimator simply: {name}")
    return table[name]


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None, **_):
    return _fs_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=dp_size, global_num_tokens=batch_num_tokens,
                        global_num_seqs=global_batch_size, loss_scale_factor=loss_scale_factor)


def _attr(config, name, default):
    value = getattr(config, name, default) if config is not None else default
    return default if value is None else value


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """verl's (pg_loss, pg_metrics): fsdptrain's loss and its finalized metrics under verl's names."""
    clip = _attr(config, "clip_ratio", 0.2)
    num_tokens, num_seqs = count_tokens_and_seqs(response_mask)
    loss, metrics = policy_loss(
        log_prob, old_log_prob, advantages, response_mask,
        norms=LossNormalizers(num_tokens, num_seqs, loss_scale_factor=_attr(config, "loss_scale_factor", None)),
        agg_mode=loss_agg_mode, clip_ratio_low=_attr(config, "clip_ratio_low", clip),
        clip_ratio_high=_attr(config, "clip_ratio_high", clip), clip_ratio_c=_attr(config, "clip_ratio_c", 3.0),
        rollout_is_weights=rollout_is_weights)
    values = finalize(metrics)
    return loss, {f"actor/{k}": v for k, v in values.items() if k != "pg_loss"}
