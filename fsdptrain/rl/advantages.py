"""Advantage estimators: GAE, GRPO group normalisation, RLOO; whitening with statistics handed in.

Legend: `_BT` padded `[B, T]` per-token tensors, `_N` one value per sequence. Nothing here reduces across ranks:
statistics that span ranks (whitening) come in as arguments; `moment_stats` gives the additive statistics the loop
all-reduces. A prompt group never spans ranks (docs/architecture.md, rank ownership), so GRPO and RLOO are local.

Departures from verl: a GRPO group of one gets advantage 0 (verl passes its raw score through, as if mean 0 and
std 1); masked positions of GAE's outputs are 0 (verl leaves the carried value there).
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each row, returns (advantages_BT, returns_BT).

    Walking back over valid positions t (masked ones are skipped, so time runs over valid tokens only):
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,   R_t = A_t + V_t
    where V_next and A_next belong to the next *valid* token of the row, and are 0 after the last valid token (a
    value or reward at a masked position never leaks in). Masked positions of both outputs are 0.
    """
    if not (rewards_BT.shape == values_BT.shape == mask_BT.shape) or rewards_BT.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards_BT.shape)}, values {tuple(values_BT.shape)} and mask {tuple(mask_BT.shape)} "
            "must all be [B, T]"
        )
    with torch.no_grad():
        valid = mask_BT != 0
        zero = torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)
        rewards = torch.where(valid, rewards_BT, zero)
        values = torch.where(valid, values_BT, zero)
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_adv
            v_t = valid[:, t]
            next_adv = torch.where(v_t, adv_t, next_adv)
            next_value = torch.where(v_t, values[:, t], next_value)
            advantages[:, t] = torch.where(v_t, adv_t, zero)
        returns = torch.where(valid, advantages + values, zero)
    return advantages, returns


def moment_stats(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sum, sum of squares, count) of `x` over valid positions, float64: additive, for an all-reduce(SUM)."""
    valid = mask != 0
    xv = torch.where(valid, x.detach().to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    return xv.sum(), xv.square().sum(), valid.sum().to(torch.float64)


def mean_var(total: Tensor | float, total_sq: Tensor | float, count: Tensor | float, *, unbiased: bool = True):
    """Mean and variance from `moment_stats` (summed over ranks); unbiased (Bessel) by default, as verl whitens."""
    count = torch.as_tensor(count, dtype=torch.float64)
    total = torch.as_tensor(total, dtype=torch.float64)
    total_sq = torch.as_tensor(total_sq, dtype=torch.float64)
    if float(count) < (2 if unbiased else 1):
        raise ValueError(f"need at least {2 if unbiased else 1} valid values to whiten, got {float(count):g}")
    mean = total / count
    var = (total_sq - count * mean.square()) / (count - 1 if unbiased else count)
    return mean, var.clamp(min=0.0)


def whiten(
    x: Tensor, mask: Tensor, *, mean: Tensor | float, var: Tensor | float, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(x - mean) / sqrt(var + eps) at valid positions (without `- mean` if not `shift_mean`); 0 elsewhere."""
    mean = torch.as_tensor(mean, dtype=x.dtype, device=x.device)
    scale = torch.rsqrt(torch.as_tensor(var, dtype=x.dtype, device=x.device) + eps)
    out = (x - mean) * scale if shift_mean else x * scale
    return torch.where(mask != 0, out, torch.zeros((), dtype=x.dtype, device=x.device))


def _groups(scores_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if scores_N.dim() != 1 or group_ids_N.shape != scores_N.shape:
        raise ValueError(f"scores {tuple(scores_N.shape)} and group ids {tuple(group_ids_N.shape)} must both be [N]")
    unique_ids, inverse = torch.unique(group_ids_N, return_inverse=True)
    num_groups = unique_ids.numel()
    size = torch.zeros(num_groups, dtype=scores_N.dtype, device=scores_N.device).index_add(
        0, inverse, torch.ones_like(scores_N)
    )
    total = torch.zeros(num_groups, dtype=scores_N.dtype, device=scores_N.device).index_add(0, inverse, scores_N)
    return inverse, size, total


def grpo_advantages(scores_N: Tensor, group_ids_N: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: (s_i - mean_g) / (std_g + eps), or s_i - mean_g without `scale_by_std` (Dr. GRPO).

    mean_g and std_g are over the sequences of i's group; std is unbiased (n - 1), as torch.std and verl. A group
    of one has advantage 0. Broadcast over tokens by the caller (`adv_N[:, None] * mask_BT`).
    """
    with torch.no_grad():
        inverse, size, total = _groups(scores_N, group_ids_N)
        mean = total / size
        centred = scores_N - mean[inverse]
        if not scale_by_std:
            return torch.where(size[inverse] > 1, centred, torch.zeros_like(centred))
        sq = torch.zeros_like(total).index_add(0, inverse, centred.square())
        std = torch.sqrt(sq / (size - 1).clamp(min=1))
        adv = centred / (std[inverse] + eps)
        return torch.where(size[inverse] > 1, adv, torch.zeros_like(adv))


def rloo_advantages(scores_N: Tensor, group_ids_N: Tensor) -> Tensor:
    """RLOO: s_i minus the mean of the *other* scores of its group, s_i - (sum_g - s_i) / (n_g - 1); 0 if n_g = 1."""
    with torch.no_grad():
        inverse, size, total = _groups(scores_N, group_ids_N)
        n = size[inverse]
        baseline = (total[inverse] - scores_N) / (n - 1).clamp(min=1)
        return torch.where(n > 1, scores_N - baseline, torch.zeros_like(scores_N))
