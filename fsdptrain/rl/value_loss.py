"""Clipped value (critic) loss, in the padded `[B, T]` or the packed `[T]`/`[1, T]` + `cu_seqlens` layout."""

from __future__ import annotations

import torch
from torch import Tensor

from fsdptrain.rl.aggregate import LossNormalizers, SeqLayout, agg_loss_with, check_mode, masked
from fsdptrain.metrics.typed import Derived, Loss, Max, Mean, Metrics, Min, explained_variance


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    norms: LossNormalizers,
    agg_mode: str,
    cliprange_value: float | None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """loss = agg_loss(0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2), mask, agg_mode).

    `values` (v) carry the gradient; `old_values` (the critic's values at rollout) and `returns` (R) do not.
    `cliprange_value` None turns clipping off (loss 0.5 * (v - R)^2). Masked positions are ignored, NaN included.

    Metrics (over valid tokens):
        vf_loss (LOSS): agg value / dp_size.
        vf_clipfrac (MEAN, token-weighted): share of tokens where the clipped error is the larger (so never a token
            with |v - old| <= c, whose clipped value is v itself).
        values_mean, returns_mean (MEAN, token-weighted); values_min, values_max (MIN/MAX; absent when empty).
        vf_explained_var (DERIVED): 1 - Var(R - v) / Var(R) from [sum R, sum R^2, sum (R-v), sum (R-v)^2, count].
    """
    check_mode(agg_mode)
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 or None, got {cliprange_value}")
    layout = SeqLayout(values.shape, cu_seqlens, values.device)
    valid = layout.valid(mask)
    v = masked(values, valid)
    old_v = masked(old_values, valid).detach()
    ret = masked(returns, valid).detach()

    unclipped = (v - ret).square()
    if cliprange_value is None:
        err = unclipped
        clipfrac = torch.zeros_like(valid)
    else:
        # Clamp v itself: old + clamp(v - old, -c, c) can differ from v by one rounding step when |v - old| < c,
        # which would count an unclipped token as clipped.
        v_clipped = torch.clamp(v, old_v - cliprange_value, old_v + cliprange_value)
        clipped = (v_clipped - ret).square()
        err = torch.maximum(unclipped, clipped)
        clipfrac = clipped > unclipped
    vf_loss = agg_loss_with(0.5 * err, valid, agg_mode, norms, cu_seqlens=cu_seqlens)

    v_d = v.detach().to(torch.float64)
    r_d = ret.to(torch.float64)
    diff = masked(r_d - v_d, valid)
    r_m = masked(r_d, valid)
    ev_stats = [r_m.sum(), r_m.square().sum(), diff.sum(), diff.square().sum(), valid.sum()]
    metrics = Metrics(
        {
            "vf_loss": Loss(vf_loss / norms.dp_size),
            "vf_clipfrac": Mean.of(clipfrac.to(v.dtype), valid),
            "values_mean": Mean.of(v, valid),
            "returns_mean": Mean.of(ret, valid),
            "values_min": Min.of(v, valid),
            "values_max": Max.of(v, valid),
            "vf_explained_var": Derived(ev_stats, explained_variance),
        }
    )
    return vf_loss, metrics
