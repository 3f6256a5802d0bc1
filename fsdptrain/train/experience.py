"""Experience: from this rank's rollouts to per-sequence training targets.

Legend: `_R` one sequence's response-aligned values (element j belongs to response token j), `_BR` those padded.

Every model pass here is packed and runs the agreed number of forwards on every rank (a rank with fewer sequences runs
empty packs), exactly like training. Old log-probs come from the same packed forward and backend as training, so the
first mini-batch's ratio is 1 up to rounding (the on-policy guard); rollouts that carry behaviour log-probs use those
instead. Statistics that span ranks (advantage whitening) go through the all-reduce passed in by the loop.

Departures from verl: the KL-in-reward penalty uses the k1 estimator per token; GAE advantages are whitened over the
global batch with an unbiased variance; GRPO/RLOO advantages are not whitened.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.data.packing import pack_sequences, unpack_responses
from fsdptrain.data.rollout import Rollout
from fsdptrain.rl.advantages import gae, grpo_advantages, mean_var, moment_stats, rloo_advantages, whiten
from fsdptrain.train.packed_loss import policy_token_outputs, value_token_outputs
from fsdptrain.train.step import plan_agreed


@torch.no_grad()
def packed_pass(model, rollouts: Sequence[Rollout], *, forward: Callable, token_budget: int,
                device: torch.device) -> list[Tensor]:
    """``forward(model, packed) -> [T]`` over this rank's sequences in agreed packs; per sequence its `_R` values.

    Collective: every rank runs the same number of forwards.
    """
    prompts = [r.prompt_ids for r in rollouts]
    responses = [r.response_ids for r in rollouts]
    plan = plan_agreed([len(p) + len(r) for p, r in zip(prompts, responses)], token_budget)
    out: list[Optional[Tensor]] = [None] * len(rollouts)
    for pack in plan.packs:
        packed = pack_sequences(prompts, responses, pack).to(device)
        for index, values_R in zip(pack, unpack_responses(forward(model, packed), packed)):
            out[index] = values_R.detach().float().cpu()
    assert all(v is not None for v in out)
    return out  # type: ignore[return-value]


def policy_logprobs(model, rollouts, *, temperature: float, chunk_size: int, token_budget: int,
                    device: torch.device) -> list[Tensor]:
    """Response log-probs under ``model`` from the packed training forward (fused chunked projection)."""

    def forward(m, packed):
        return policy_token_outputs(m, packed, temperature=temperature, chunk_size=chunk_size,
                                    compute_entropy=False)[0]

    return packed_pass(model, rollouts, forward=forward, token_budget=token_budget, device=device)


def critic_values(model, rollouts, *, token_budget: int, device: torch.device) -> list[Tensor]:
    """Values at the response-scoring positions under the value model."""
    return packed_pass(model, rollouts, forward=value_token_outputs, token_budget=token_budget, device=device)


def token_rewards(rollouts: Sequence[Rollout], *, kl_R: Optional[Sequence[Tensor]], kl_coef: float) -> list[Tensor]:
    """Per token: the outcome reward on the last response token, minus ``kl_coef * kl_t`` on every token if given."""
    out = []
    for i, rollout in enumerate(rollouts):
        rewards_R = torch.zeros(len(rollout.response_ids), dtype=torch.float32)
        rewards_R[-1] = rollout.reward
        if kl_R is not None and kl_coef != 0.0:
            rewards_R = rewards_R - kl_coef * kl_R[i]
        out.append(rewards_R)
    return out


def reward_to_go(rewards_R: Tensor) -> Tensor:
    """Undiscounted return from each token on: ``G_t = sum_{k >= t} r_k`` (the critic's target without GAE)."""
    return torch.flip(torch.cumsum(torch.flip(rewards_R, [0]), 0), [0])


def _pad(values: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    width = max((v.numel() for v in values), default=0)
    padded_BR = torch.zeros(len(values), width, dtype=torch.float32)
    mask_BR = torch.zeros(len(values), width, dtype=torch.bool)
    for i, v in enumerate(values):
        padded_BR[i, : v.numel()] = v
        mask_BR[i, : v.numel()] = True
    return padded_BR, mask_BR


def _unpad(padded_BR: Tensor, values: Sequence[Tensor]) -> list[Tensor]:
    return [padded_BR[i, : v.numel()].clone() for i, v in enumerate(values)]


def gae_targets(rewards_R: Sequence[Tensor], values_R: Sequence[Tensor], *, gamma: float, lam: float,
                whiten_advantages: bool, sum_across_ranks: Callable[[Tensor], Tensor]) -> tuple[list, list]:
    """GAE advantages (whitened with global mean and variance when asked) and returns, per sequence."""
    rewards_BR, mask_BR = _pad(rewards_R)
    values_BR, _ = _pad(values_R)
    adv_BR, ret_BR = gae(rewards_BR, values_BR, mask_BR, gamma=gamma, lam=lam)
    if whiten_advantages:
        stats = torch.stack(moment_stats(adv_BR, mask_BR))
        total, total_sq, count = sum_across_ranks(stats)
        mean, var = mean_var(total, total_sq, count)
        adv_BR = whiten(adv_BR, mask_BR, mean=mean, var=var)
    return _unpad(adv_BR, rewards_R), _unpad(ret_BR, rewards_R)


def group_targets(rollouts: Sequence[Rollout], *, estimator: str, norm_by_std: bool) -> list[Tensor]:
    """GRPO or RLOO advantages from the outcome rewards of each prompt group, broadcast over each response."""
    scores_N = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    groups_N = torch.tensor([r.group for r in rollouts], dtype=torch.long)
    if estimator == "grpo":
        adv_N = grpo_advantages(scores_N, groups_N, scale_by_std=norm_by_std)
    else:
        adv_N = rloo_advantages(scores_N, groups_N)
    return [torch.full((len(r.response_ids),), float(a)) for r, a in zip(rollouts, adv_N)]

