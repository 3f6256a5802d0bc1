"""check-metrics, part 7: the step's whole update, several mini-batches and epochs, against a step split by hand.

The layouts run one mini-batch with no optimiser step. This pass runs the trainer's own update loop
(``Trainer.minibatches`` and ``Trainer.update``: per epoch, per mini-batch, global normalisers, micro-batches, clip,
optimiser step, metrics merged over the updates) on the checked batch with ``trainer.mini_batches_per_step`` and
``algorithm.ppo_epochs`` as configured, or 2 and 2 when configured at 1
(:func:`fsdptrain.check.batch.update_shape`), and compares every
number it logs with a reference that splits the step by hand:

- mini-batch m holds the prompt groups g with ``g // (P / M) == m`` (P groups, M mini-batches);
- per epoch and mini-batch, for the policy then the critic: the one-sequence-at-a-time reference loss with that
  mini-batch's own counts N_m and S_m (:mod:`fsdptrain.check.reference`), backward, the global norm of the whole
  gradient in float64, every gradient entry scaled by min(1, clip / (norm + 1e-6)), then a plain SGD step; a
  mini-batch with no counted token (rollout rejection dropped them all) takes no step and has norm 0
  (docs/loss.md, "A mini-batch with no counted token");
- the logged values: a loss (``pg_loss``, ``kl_loss``, ``vf_loss``) is the mean over the updates of each update's
  value; a mean is pooled over every valid token of every update; an extremum is taken over all of them;
  ``*/grad_norm`` and ``loss/global_num_tokens``, ``loss/global_num_seqs`` are means over the updates.

The optimiser of both sides is plain SGD (:func:`smooth_optimizer`), not the run's AdamW: AdamW's first step moves
every weight by about the learning rate whatever the size of its gradient, so two gradients near zero that differ by
rounding become steps of opposite sign, and every number after the first step differs by far more than the rounding
that caused it (measured on SmolLM2-135M in float32: 3.6e-3 relative). SGD's step is a smooth function of the
gradient, so the later mini-batches and epochs agree to the rounding of the first. Its learning rate
``lr * sqrt(P) / |g|`` (P trainable parameters, |g| the largest clipped gradient norm of the mini-batches at the
starting weights, the reference's) moves the weights about as far as AdamW's first step would, so the second
epoch's ratios are not 1. The largest, not the first mini-batch's: a mini-batch whose every advantage is 0 and whose
policy equals the reference (the KL's d = 0) has a gradient of pure rounding (8e-17 in float64), and a learning rate
scaled by that norm stepped the next mini-batch by 1e16 (the weights overflowed, and its direction was rounding). The trainer's own update loop
(mini-batches, normalisers, micro-batches, clip, metrics merged) runs unchanged; only its optimiser object is
swapped for the pass. The optimiser itself is not what the check proves (docs/check-metrics.md).

The explained variance (over the pooled vectors), the drafter and an MoE policy's per-layer expert load (compared in
every layout) are not compared here (docs/check-metrics.md); its load-balancing loss (``moe/aux_loss``, each
mini-batch's own counts) is. The
models' weights and optimiser states are restored after the pass: check-metrics leaves the run unchanged. Without
the prompt-only fixture (it belongs to no prompt group).
"""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import OmegaConf

from fsdptrain.check.batch import CheckBatch, CheckSession, UpdateShape
from fsdptrain.check.compare import Outcome
from fsdptrain.check.layouts import clip_coefficient, grad_norm
from fsdptrain.check.moe_reference import reference_moe_norms
from fsdptrain.check.reference import Counts, reference_critic, reference_policy
from fsdptrain.distributed.fsdp import held_grads, reshard_all, zero_grads
from fsdptrain.model.loading import trainable_parameters
from fsdptrain.metrics.typed import comparable, finalize
from fsdptrain.train.step import MiniBatch

LOSSES = ("pg_loss", "kl_loss", "vf_loss")
SKIPPED = ("critic/vf_explained_var",)


class Snapshot:
    """The trained models' sharded weights and optimiser states, to put back after the pass."""

    def __init__(self, pairs: list[tuple[torch.nn.Module, torch.optim.Optimizer]]):
        self.saved = []
        for model, optimizer in pairs:
            reshard_all(model)  # parameters() must yield the sharded tensors the optimiser holds
            weights = [p.detach().clone() for p in trainable_parameters(model)]
            state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                     for p, s in optimizer.state.items()}
            self.saved.append((model, optimizer, weights, state))

    def restore(self) -> None:
        for model, optimizer, weights, state in self.saved:
            reshard_all(model)
            zero_grads(model)
            with torch.no_grad():
                for param, saved in zip(trainable_parameters(model), weights):
                    param.copy_(saved)
            optimizer.state.clear()
            optimizer.state.update({p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                                    for p, s in state.items()})


def _split(batch: CheckBatch, shape: UpdateShape, num_prompts: int) -> list[tuple[MiniBatch, Optional[list], list]]:
    """The full batch's real sequences split into mini-batches by prompt group, by hand; with their behaviour
    log-probs when there is a rollout correction, and their (counted, policy) masks."""
    per_mb = num_prompts // shape.mini_batches
    out = []
    for m in range(shape.mini_batches):
        index = [i for i, g in enumerate(batch.groups) if g // per_mb == m]
        full = batch.full
        sub = MiniBatch([full.prompts[i] for i in index], [full.responses[i] for i in index],
                        [full.targets[i] for i in index])
        masks = ([batch.counted_masks()[i] for i in index], [batch.policy_token_masks()[i] for i in index])
        out.append((sub, None if batch.behaviour is None else [batch.behaviour[i] for i in index], masks))
    return out


def smooth_optimizer(model, lr: float, clipped_norm: float) -> torch.optim.SGD:
    """Plain SGD over ``model``'s trainable parameters at ``lr * sqrt(P) / clipped_norm``: its first step moves the
    weights by ``lr * sqrt(P)`` in norm, as far as AdamW's first step (every one of P entries by about ``lr``);
    ``lr`` itself when the norm is 0 (nothing moves). See the module docstring for why not AdamW."""
    params = trainable_parameters(model)
    num_params = sum(p.numel() for p in params)
    return torch.optim.SGD(params, lr=lr * num_params ** 0.5 / clipped_norm if clipped_norm > 0 else lr)


def _clipped_norm(model, max_norm: float) -> float:
    """The float64 norm of the whole gradient (over the held shards) after clipping at ``max_norm`` (collective)."""
    norm = grad_norm(held_grads(model))
    return norm * clip_coefficient(norm, max_norm)


def _step_by_hand(model, optimizers: dict, prefix: str, lr: float, max_norm: float, counts: Counts) -> float:
    """Clip by the float64 norm of the whole gradient (over the held shards) and step ``optimizers[prefix]`` (made
    by :func:`smooth_optimizer` before the first step, :func:`reference_update`); the norm (collective). No step and
    norm 0 when the mini-batch has no counted token (the same on every rank: ``counts`` are the whole
    mini-batch's)."""
    if counts.num_tokens == 0:
        zero_grads(model)
        return 0.0
    norm = grad_norm(held_grads(model))
    coef = clip_coefficient(norm, max_norm)
    reshard_all(model)  # parameters() must yield the sharded tensors the optimiser steps
    optimizer = optimizers[prefix]
    with torch.no_grad():
        for param in trainable_parameters(model):
            if param.grad is not None:
                param.grad.mul_(coef)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _merge(per_update: list[dict[str, float]], tokens: list[int], prefix: str) -> dict[str, float]:
    """What the step logs from each update's directly computed metrics: losses averaged over the updates, means
    pooled over the tokens of every update, extrema over all of them."""
    out = {}
    names = dict.fromkeys(name for m in per_update for name in m)  # an update with no counted token has no means
    for name in names:
        values = [m[name] for m in per_update if name in m]
        if name in LOSSES:
            out[prefix + name] = sum(values) / len(values)
        elif name.endswith("_min"):
            out[prefix + name] = min(values)
        elif name.endswith("_max"):
            out[prefix + name] = max(values)
        else:
            weights = [n for m, n in zip(per_update, tokens) if name in m]
            out[prefix + name] = sum(v * n for v, n in zip(values, weights)) / sum(weights)
    return out


def reference_update(session: CheckSession, shape: UpdateShape, optimizers: dict
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """The step split by hand (see the module docstring): the logged values and the tolerance scales; fills
    ``optimizers`` (by prefix) with the SGD each model stepped. Changes the weights: snapshot first."""
    cfg, tr, batch = session.cfg, session.trainer, session.batch
    num_prompts = cfg.rollout.prompts_per_step
    splits = _split(batch, shape, num_prompts)
    models = [("actor/", tr.models.policy, cfg.trainer.lr, cfg.trainer.grad_clip)]
    if tr.models.critic is not None:
        models.append(("critic/", tr.models.critic, cfg.trainer.critic_lr, cfg.trainer.critic_grad_clip))
    coef = tr.models.policy_part.moe_coef

    def backward(prefix, model, sub, behaviour, counted, policy, counts):
        zero_grads(model)
        if prefix == "actor/":
            moe = None if coef is None else reference_moe_norms(model, sub, coef)  # the mini-batch's own counts
            return reference_policy(model, sub, tr.policy_settings, counts, counted=counted, behaviour=behaviour,
                                    correction=batch.correction, policy_masks=policy, moe=moe)
        return reference_critic(model, sub, tr.value_settings, counts, counted=counted)

    for prefix, model, lr, max_norm in models:  # the SGD's scale: the largest clipped norm at the starting weights
        scale = 0.0
        for sub, behaviour, (counted, policy) in splits:
            counts = Counts.of(counted, tr.loss_scale_factor)
            if counts.num_tokens:
                backward(prefix, model, sub, behaviour, counted, policy, counts)
                scale = max(scale, _clipped_norm(model, max_norm))
        zero_grads(model)
        reshard_all(model)  # parameters() must yield the sharded tensors the optimiser steps
        optimizers[prefix] = smooth_optimizer(model, lr, scale)
    metrics = {prefix: [] for prefix, *_ in models}
    norms = {prefix: [] for prefix, *_ in models}
    loss_scales: dict[str, list[float]] = {}
    tokens, counts_seen, aux = [], [], []
    for _ in range(shape.epochs):
        for sub, behaviour, (counted, policy) in splits:
            counts = Counts.of(counted, tr.loss_scale_factor)
            tokens.append(counts.num_tokens)
            counts_seen.append(counts)
            for prefix, model, lr, max_norm in models:
                _, found, scales = backward(prefix, model, sub, behaviour, counted, policy, counts)
                aux.extend(v for k, v in found.items() if k == "moe/aux_loss")
                metrics[prefix].append({k: v for k, v in found.items() if not k.startswith("moe/")})
                for name in LOSSES:
                    if name in scales:
                        loss_scales.setdefault(prefix + name, []).append(scales[name])
                norms[prefix].append(_step_by_hand(model, optimizers, prefix, lr, max_norm, counts))
    values = {}
    for prefix in metrics:
        values.update(_merge(metrics[prefix], tokens, prefix))
        values[prefix + "grad_norm"] = sum(norms[prefix]) / len(norms[prefix])
    values["loss/global_num_tokens"] = sum(c.num_tokens for c in counts_seen) / len(counts_seen)
    values["loss/global_num_seqs"] = sum(c.num_seqs for c in counts_seen) / len(counts_seen)
    if aux:  # an MoE policy's load-balancing loss: a LOSS, the mean over the updates (docs/moe.md)
        values["moe/aux_loss"] = sum(aux) / len(aux)
    if batch.on_policy:
        values["actor/on_policy_max_ratio_dev"] = 0.0
    for name in SKIPPED:
        values.pop(name, None)
    return values, {name: sum(s) / len(s) for name, s in loss_scales.items()}


def trainer_update(session: CheckSession, shape: UpdateShape, optimizers: dict) -> Outcome:
    """The trainer's own update loop on this rank's share, with ``shape``'s mini-batches and epochs, each part
    stepping a fresh copy of the reference's SGD in ``optimizers`` (by prefix) instead of its AdamW (collective).
    Changes the weights: snapshot first."""
    tr, batch = session.trainer, session.batch
    real = len(batch.rollouts)  # this rank's real sequences come first in ``local``, in its rollouts' order
    shaped = OmegaConf.create(OmegaConf.to_container(tr.cfg, resolve=True))
    shaped.trainer.mini_batches_per_step = shape.mini_batches
    shaped.algorithm.ppo_epochs = shape.epochs
    saved_cfg, saved_extensions = tr.cfg, tr.extensions
    parts = [p for p in (tr.models.policy_part, tr.models.critic_part) if p is not None]
    saved_optimizers = [p.optimizer for p in parts]
    tr.cfg, tr.extensions = shaped, []  # the policy and critic alone: an auxiliary loss is checked on its own
    for part in parts:
        if part.prefix in optimizers:
            reshard_all(part.model)  # the SGD must hold the sharded parameters
            part.optimizer = torch.optim.SGD(trainable_parameters(part.model),
                                             lr=optimizers[part.prefix].param_groups[0]["lr"])
    try:
        batches = tr.minibatches(batch.rollouts, batch.local.targets[:real])
        merged, facts = tr.update(batches, batch.on_policy)
    finally:
        tr.cfg, tr.extensions = saved_cfg, saved_extensions
        for part, optimizer in zip(parts, saved_optimizers):
            part.optimizer = optimizer
    kinds = comparable(merged)
    values = {name: v for name, v in finalize(merged).items() if name in kinds}
    values.update({name: v for name, v in finalize(facts).items() if not name.startswith("drafter/")})
    for name in [*SKIPPED, *(n for n in values if n.startswith("moe/layer_"))]:
        values.pop(name, None)
    return Outcome(shape.layout, values, kinds, covers=("actor/", "critic/", "loss/", "moe/"))


def update_pass(session: CheckSession, shape: UpdateShape) -> tuple[dict[str, float], Outcome, dict[str, float]]:
    """The reference values, the trainer's outcome and the scales; the weights are restored after (collective)."""
    tr = session.trainer
    pairs = [(tr.models.policy, tr.models.policy_part.optimizer)]
    if tr.models.critic is not None:
        pairs.append((tr.models.critic, tr.models.critic_part.optimizer))
    snapshot = Snapshot(pairs)
    optimizers: dict[str, torch.optim.SGD] = {}
    try:
        want, scales = reference_update(session, shape, optimizers)
        snapshot.restore()
        got = trainer_update(session, shape, optimizers)
    finally:
        snapshot.restore()
    return want, got, scales
