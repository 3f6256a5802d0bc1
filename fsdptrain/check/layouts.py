"""check-metrics, part 3: the layouts. The same mini-batch, forward and backward, no optimiser step.

Legend: `_BL` padded `[B, L]`.

Every layout but the last runs the WHOLE mini-batch on every rank, identically, so all ranks run the same forwards in
lockstep and FSDP's mean over ranks of identical gradients changes nothing; these layouts therefore use the batch's
own counts with dp_size 1, except the simulated data-parallel one:

- ``per-sequence``: the product's per-sequence path (``per_sequence_*_loss``): one unpacked forward per sequence;
- ``padded``: one ``[B, L]`` forward with an attention mask on sdpa and the padded ``agg_loss``;
- ``packed budget=B``: the train step's ``accumulate_gradients`` with the configured token budget, and again with
  the smallest budget that fits the longest sequence (many packs), whatever the configured one;
- ``micro-batches=1``, ``=2``, ``=n (one sequence each)``: the same ``accumulate_gradients`` with packs forced by
  ``plan_packs(min_packs=)`` or by hand;
- ``simulated dp=N`` (on one rank only): the sequences split round-robin into N shards; each shard runs its packs
  with the global counts and dp_size N, the shards' gradients are averaged (what FSDP's reduce-scatter does) and
  their metrics reduced like ranks (``flatten`` / SUM, MIN, MAX / ``unflatten``);
- ``ranks=W``: the product path on the real ranks: each rank's own share, ``global_normalizers``,
  ``world.dp_size(mesh)``, ``accumulate_gradients`` and ``reduce_metrics``; FSDP averages the gradients over the
  mesh's ranks;
- with ``parallel.cp=C`` > 1, ``context parallel cp=C``: the train step's path under context parallelism on the
  real ranks: each CP group of C ranks holds its data-parallel share (sequences ``i % (W / C) == rank // C``), every
  row split over the group (fsdptrain/distributed/context_parallel.py), ``global_normalizers`` with the group,
  ``world.dp_size(mesh)`` (dp x cp) and ``reduce_metrics``;
- with ``trainer.share_prompts=true``, ``shared prompts, ranks=W``: ``ranks=W`` again with each pack's forward
  holding each of its prompts once (fsdptrain/data/shared_prompts.py), compared like every layout with the
  reference, which never shares.

The off-policy pass runs a subset of them (:func:`layouts` says which and why).

Every packed layout runs the train step's own ``accumulate_gradients`` (looked up on ``fsdptrain.train.step`` at call
time), and the loss it reports is what that function summed: the scalars backward ran on, then averaged over the
(simulated or real) data-parallel ranks as FSDP averages gradients.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fsdptrain.check.compare import worst_of
from fsdptrain.data.packing import PackPlan, PaddedBatch, pad_sequences, plan_packs
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.distributed.context_parallel import build_context_group
from fsdptrain.distributed.fsdp import held_grads, zero_grads
from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.model.loading import trainable_parameters
from fsdptrain.model.moe import routing
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.buffers import ReduceBuffers, Schema, flatten, unflatten
from fsdptrain.metrics.typed import Metrics, close_minibatch, comparable, finalize, merge_all
from fsdptrain.rl.fused_loss import ValueLossSettings
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.rl.policy_loss import entropy_from_logits, policy_loss
from fsdptrain.rl.value_loss import value_loss
from fsdptrain.train import pack_losses, step
from fsdptrain.train.step import MiniBatch

Grads = dict[str, Tensor]
"""A model's gradient by parameter name, as this rank holds it (``held_grads``: FSDP2's sharded ``DTensor``s, never
gathered). Its statistics below are collective and count every entry once."""


@dataclass(frozen=True)
class Part:
    """One trained model under check: the policy ("actor/") or the critic ("critic/") and its loss functions."""

    prefix: str
    model: torch.nn.Module
    settings: PolicyLossSettings | ValueLossSettings
    packed_loss: Callable
    per_sequence_loss: Callable
    padded_loss: Callable
    moe_coef: Optional[float] = None
    """An MoE policy's load-balancing weight (`fsdptrain.train.trained_part.TrainedPart.moe_coef`); None otherwise."""


@dataclass
class Context:
    """What every layout gets: the batches, the full batch's normalisers (dp 1) and where to run."""

    full: MiniBatch
    local: MiniBatch
    norms: LossNormalizers
    token_budget: int
    simulated_dp: int
    mesh: object
    device: torch.device


@dataclass
class Run:
    """A layout's result for one model: the loss, the kinds and finalised values of its metrics, the gradient."""

    loss: float
    metrics: Metrics
    grads: Grads

    def values(self) -> dict[str, float]:
        names = comparable(self.metrics)
        return {name: value for name, value in finalize(close_minibatch(self.metrics)).items() if name in names}


# ---- the padded layout ------------------------------------------------------------------------------------------


def _padded(per_seq_R, batch: PaddedBatch, device) -> Tensor:
    """Response-aligned values of each sequence at the padded positions that score them; 0 elsewhere. `[B, L]`."""
    out_BL = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    for b, values_R in enumerate(per_seq_R):
        out_BL[b, batch.response_positions[b]] = values_R.reshape(-1).float()
    return out_BL.to(device)


def _padded_forward(model, batch: PaddedBatch, device) -> Tensor:
    with generation_attention(model):
        return model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                     use_cache=False).logits


def _row_logprobs_entropy(logits_LV: Tensor, labels_L: Tensor, temperature: float,
                          dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    scaled_LV = logits_LV.to(dtype) / temperature
    return (torch.log_softmax(scaled_LV, dim=-1).gather(-1, labels_L[:, None])[:, 0],
            entropy_from_logits(scaled_LV))


def padded_logprobs_entropy(logits_BLV: Tensor, labels_BL: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probs of ``labels_BL`` and entropy from the full logits with a plain log-softmax, each row under
    activation checkpointing: the same numbers and gradient, but only the logits are kept for backward, not the
    several `[B, L, V]` intermediates of the softmaxes (in float64 on a 49k vocabulary, gigabytes per batch). In
    float32 or wider (float64 under check-metrics' float64 mode, decided here: the recomputation in backward runs
    outside that mode)."""
    dtype = torch.promote_types(logits_BLV.dtype, torch.float32)
    rows = [checkpoint(_row_logprobs_entropy, row_LV, labels_L, temperature, dtype, use_reentrant=False)
            for row_LV, labels_L in zip(logits_BLV.unbind(0), labels_BL)]
    return torch.stack([lp for lp, _ in rows]), torch.stack([entropy for _, entropy in rows])


def padded_policy_loss(model, prompts, responses, targets, *, norms: LossNormalizers,
                       settings: PolicyLossSettings) -> tuple[Tensor, Metrics]:
    """The policy loss of the whole batch as one right-padded `[B, L]` forward (full logits, plain log-softmax)."""
    device = next(model.parameters()).device
    batch = pad_sequences(prompts, responses, response_masks=[t.response_mask for t in targets])
    labels_BL = torch.where(batch.label_mask, batch.labels, torch.zeros_like(batch.labels)).to(device)
    with routing(model, record=norms.moe is not None) as routes:
        logits_BLV = _padded_forward(model, batch, device)
    logprobs_BL, entropy_BL = padded_logprobs_entropy(logits_BLV, labels_BL, settings.temperature)
    loss, metrics = policy_loss(
        logprobs_BL, _padded([t.old_logprobs for t in targets], batch, device),
        _padded([t.advantages for t in targets], batch, device), batch.response_mask.to(device), norms=norms,
        settings=settings,
        ref_logprobs=(_padded([t.ref_logprobs for t in targets], batch, device) if settings.use_reference
                      else None),
        entropy=entropy_BL,
        rollout_is_weights=(_padded([t.is_weights for t in targets], batch, device) if settings.use_is_weights
                            else None),
    )
    # the train step's token weights and share (an MoE policy: docs/moe.md), with the padding of [B, L] masked
    return pack_losses.with_moe_terms(loss, metrics, routes, batch, norms)


def padded_value_loss(model, prompts, responses, targets, *, norms: LossNormalizers,
                      settings: ValueLossSettings) -> tuple[Tensor, Metrics]:
    """The value loss of the whole batch as one right-padded `[B, L]` forward."""
    device = next(model.parameters()).device
    batch = pad_sequences(prompts, responses, response_masks=[t.response_mask for t in targets])
    values_BL = _padded_forward(model, batch, device)[..., 0].float()
    return value_loss(values_BL, _padded([t.old_values for t in targets], batch, device),
                      _padded([t.returns for t in targets], batch, device), batch.response_mask.to(device),
                      norms=norms, agg_mode=settings.agg_mode, cliprange_value=settings.cliprange_value)


# ---- running packs: the train step's own accumulation -------------------------------------------------------------


def run_packs(part: Part, batch: MiniBatch, plan: Optional[PackPlan], norms: LossNormalizers, ctx: Context,
              *, share_prompts: bool = False) -> tuple[float, Metrics]:
    """``accumulate_gradients`` of the train step (looked up on its module, so what runs is what ``fsdptrain train``
    runs) on ``batch`` with ``plan`` (None: the trainer's agreed plan under the budget); the summed scalar backward
    ran on, and the merged metrics."""
    accumulated = step.accumulate_gradients(part.model, batch, loss_fn=part.packed_loss, settings=part.settings,
                                            norms=norms, token_budget=ctx.token_budget, device=ctx.device, plan=plan,
                                            share_prompts=share_prompts)
    return accumulated.loss, accumulated.metrics


def _fresh(part: Part) -> None:
    zero_grads(part.model)


def _sub_batch(batch: MiniBatch, indices: list[int]) -> MiniBatch:
    return MiniBatch([batch.prompts[i] for i in indices], [batch.responses[i] for i in indices],
                     [batch.targets[i] for i in indices])


def per_sequence(part: Part, ctx: Context) -> Run:
    """``part.per_sequence_loss`` (a sum over sequences, each with the batch's global normalisers) one sequence at a
    time, backward after each: the same sum and gradient, with one sequence's activations alive at a time instead of
    the whole batch's (the metrics merged as the function merges them)."""
    _fresh(part)
    b = ctx.full
    total, collected = 0.0, []
    for i in range(b.num_seqs):
        loss, metrics = part.per_sequence_loss(part.model, [b.prompts[i]], [b.responses[i]], [b.targets[i]],
                                               norms=ctx.norms, settings=part.settings)
        if loss.requires_grad:
            loss.backward()
        total += float(loss.detach())
        collected.append(metrics)
    return Run(total, merge_all(collected), held_grads(part.model))


def padded(part: Part, ctx: Context) -> Run:
    _fresh(part)
    b = ctx.full
    loss, metrics = part.padded_loss(part.model, b.prompts, b.responses, b.targets, norms=ctx.norms,
                                     settings=part.settings)
    loss.backward()
    return Run(float(loss.detach()), metrics, held_grads(part.model))


def packed_with_budget(token_budget: Optional[int] = None) -> Callable[[Part, Context], Run]:
    """The trainer's agreed plan under ``token_budget`` (None: the configured one)."""

    def run(part: Part, ctx: Context) -> Run:
        _fresh(part)
        budgeted = ctx if token_budget is None else dataclasses.replace(ctx, token_budget=token_budget)
        loss, metrics = run_packs(part, ctx.full, None, ctx.norms, budgeted)
        return Run(loss, metrics, held_grads(part.model))

    return run


def forced_packs(plan: PackPlan) -> Callable[[Part, Context], Run]:
    def run(part: Part, ctx: Context) -> Run:
        _fresh(part)
        loss, metrics = run_packs(part, ctx.full, plan, ctx.norms, ctx)
        return Run(loss, metrics, held_grads(part.model))

    return run


def simulated_dp(part: Part, ctx: Context) -> Run:
    """N shards in this process, each as one data-parallel rank would run it; FSDP's gradient mean done by hand: the
    shards' gradients accumulate in the model, then are divided by N, so the model holds the mean (for the clip)."""
    num_shards = ctx.simulated_dp
    norms = dataclasses.replace(ctx.norms, dp_size=num_shards)
    losses, shard_metrics = [], []
    _fresh(part)
    for shard in range(num_shards):
        batch = _sub_batch(ctx.full, [i for i in range(ctx.full.num_seqs) if i % num_shards == shard])
        plan = plan_packs(batch.lengths(), ctx.token_budget)  # no sequence: one empty pack, as on a real rank
        loss, metrics = run_packs(part, batch, plan, norms, ctx)
        losses.append(loss)
        shard_metrics.append(metrics)
    with torch.no_grad():
        for param in trainable_parameters(part.model):
            if param.grad is not None:
                param.grad.div_(num_shards)
    return Run(sum(losses) / num_shards, reduce_like_ranks(shard_metrics), held_grads(part.model))


def reduce_like_ranks(per_rank: list[Metrics]) -> Metrics:
    """The rank reduction of ``reduce_metrics`` with the ranks simulated: SUM, MIN and MAX over the flat buffers."""
    schema = Schema.of(*per_rank)
    buffers = [flatten(m, schema) for m in per_rank]
    return unflatten(ReduceBuffers(torch.stack([b.sum for b in buffers]).sum(0),
                                   torch.stack([b.min for b in buffers]).amin(0),
                                   torch.stack([b.max for b in buffers]).amax(0)), schema)


def shared_prompts_ranks(part: Part, ctx: Context) -> Run:
    """``real_ranks`` with shared prompts."""
    return real_ranks(part, ctx, share_prompts=True)


def real_ranks(part: Part, ctx: Context, *, share_prompts: bool = False) -> Run:
    """The train step's own path on this rank's share; the loss averaged over the mesh's ranks, as FSDP averages."""
    _fresh(part)
    norms = step.global_normalizers(ctx.local, dp_size=world.dp_size(ctx.mesh),
                                    loss_scale_factor=ctx.norms.loss_scale_factor)
    plan = None
    if part.moe_coef is not None:  # the step's own load-balancing counts of this rank's share (collective)
        plan = step.agreed_plan(ctx.local, ctx.token_budget, share_prompts=share_prompts)
        norms = step.with_moe_counts(norms, part.model, ctx.local, plan, coef=part.moe_coef, device=ctx.device,
                                     share_prompts=share_prompts)
    loss, metrics = run_packs(part, ctx.local, plan, norms, ctx, share_prompts=share_prompts)
    total = world.all_reduce_sum(torch.tensor([loss], dtype=torch.float64))
    return Run(float(total[0]) / ctx.mesh.size(), reduce_metrics(metrics), held_grads(part.model))


def context_parallel(cp: int) -> Callable[[Part, Context], Run]:
    """The train step's path with CP groups of ``cp`` ranks (collective: the groups are built on every rank)."""

    def run(part: Part, ctx: Context) -> Run:
        _fresh(part)
        group = build_context_group(cp)
        num_groups = world.world_size() // cp
        share = _sub_batch(ctx.full, [i for i in range(ctx.full.num_seqs) if i % num_groups == world.rank() // cp])
        norms = step.global_normalizers(share, dp_size=world.dp_size(ctx.mesh),
                                        loss_scale_factor=ctx.norms.loss_scale_factor, context=group)
        accumulated = step.accumulate_gradients(part.model, share, loss_fn=part.packed_loss, settings=part.settings,
                                                norms=norms, token_budget=ctx.token_budget, device=ctx.device,
                                                context=group)
        # every rank of a group summed the same scalars: its first rank's count once, averaged as FSDP averages
        mine = accumulated.loss if group.rank == 0 else 0.0
        total = world.all_reduce_sum(torch.tensor([mine], dtype=torch.float64))
        return Run(float(total[0]) / ctx.mesh.size(), reduce_metrics(accumulated.metrics),
                   held_grads(part.model))

    return run


def layouts(full: MiniBatch, *, token_budget: int, simulated_dp_size: int, world_size: int,
            share_prompts: bool = False, cp: int = 1,
            off_policy: bool = False) -> list[tuple[str, Callable[[Part, Context], Run]]]:
    """The layouts to run, by name, in order (the pack choices depend on the batch's lengths only).

    Whatever the configured budget, one layout packs under the smallest budget that fits the longest sequence
    (many packs), and the simulated data-parallel size is at least 2. ``share_prompts`` (the configured
    ``trainer.share_prompts``) adds the shared-prompt layout on the real ranks (left out otherwise: it costs a
    forward and backward of the batch). Each layout costs a forward and backward of the whole batch, so none runs
    that another one already proves (docs/check-metrics.md, "The layouts"):

    - ``packed budget=B`` only when the batch needs more than one pack under B: else its plan is
      ``micro-batches=1``'s (the trainer's agreed plan itself runs in ``ranks=W``);
    - ``simulated dp`` only on one rank: on several, ``ranks=W`` runs the dp factor and the rank reduction for real;
    - shared prompts on the real ranks only: the same forward as a single-process shared layout, and the step's own
      normalisers besides;
    - ``off_policy`` (the off-policy pass, whose job is the loss paths that bind only off-policy, the same per-token
      functions in every layout): the configured budget's plan, one sequence per pack (many packs, every
      extremum merged, the prompt-only fixture alone), ``simulated dp`` on one rank and ``ranks=W``.
    """
    if off_policy:
        return _off_policy_layouts(full, token_budget=token_budget, simulated_dp_size=simulated_dp_size,
                                   world_size=world_size, cp=cp)
    lengths = full.lengths()
    total, longest, n = sum(lengths), max(lengths), full.num_seqs
    out = [("per-sequence", per_sequence), ("padded", padded)]
    if total > token_budget:  # else its one pack is micro-batches=1's: the same forward and backward
        out.append((f"packed budget={token_budget}", packed_with_budget()))
    if longest < token_budget:
        out.append((f"packed budget={longest} (small)", packed_with_budget(longest)))
    out += [
        ("micro-batches=1", forced_packs(plan_packs(lengths, total))),
        ("micro-batches=2", forced_packs(plan_packs(lengths, total, min_packs=2))),
        (f"micro-batches={n} (one sequence each)", forced_packs(_one_each(lengths))),
    ]
    out += _data_parallel(simulated_dp_size, world_size, cp)
    if share_prompts:
        out.append((f"shared prompts, ranks={world_size}", shared_prompts_ranks))
    return out


def _data_parallel(simulated_dp_size: int, world_size: int, cp: int) -> list[tuple[str, Callable]]:
    """``simulated dp`` (one rank only), ``ranks=W`` and, with ``cp`` > 1, the context-parallel layout."""
    out = [(f"simulated dp={simulated_dp_size}", simulated_dp)] if world_size == 1 else []
    out.append((f"ranks={world_size}", real_ranks))
    if cp > 1:
        out.append((f"context parallel cp={cp}", context_parallel(cp)))
    return out


def _off_policy_layouts(full: MiniBatch, *, token_budget: int, simulated_dp_size: int, world_size: int,
                        cp: int) -> list[tuple[str, Callable]]:
    """The off-policy pass's layouts (see :func:`layouts`)."""
    lengths = full.lengths()
    return [(f"packed budget={token_budget}", packed_with_budget()),
            (f"micro-batches={full.num_seqs} (one sequence each)", forced_packs(_one_each(lengths))),
            *_data_parallel(simulated_dp_size, world_size, cp)]


def _one_each(lengths: list[int]) -> PackPlan:
    budget = max(lengths)
    return PackPlan([[i] for i in range(len(lengths))], list(lengths), [n / budget for n in lengths], budget)


CLIP_PROBE = 0.5
"""The clip threshold of the clip rows, as a share of the reference's gradient norm: the clip binds in every layout."""


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor torch-style clipping applies to every gradient entry: min(1, max_norm / (norm + 1e-6)); 1 when
    ``max_norm`` is not positive (no clipping)."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def trainer_clip(part: Part, pre_clip: Grads, max_norm: float) -> tuple[float, float]:
    """The trainer's own clip-and-norm path (``clip_grad_norm_`` as the train step calls it, looked up on its module)
    on the gradient the layout left in the (sharded) model: the norm it returns, which ``*/grad_norm`` logs, and the
    coefficient it applied, measured as the clipped norm over the ``pre_clip`` norm. Collective."""
    before = grad_norm(pre_clip)  # first: the held gradient is the model's own tensor, which the clip scales
    logged = float(step.clip_grad_norm_(trainable_parameters(part.model), max_norm))
    after = grad_norm(held_grads(part.model))
    return logged, (after / before if before > 0 else 1.0)


def _held(grad: Tensor) -> tuple[Tensor, int]:
    """This rank's entries of ``grad`` and how many ranks hold each of them: a ``DTensor`` is split over its mesh's
    sharded dimensions and copied over the others (HSDP's replicas); a plain tensor is whole on every rank."""
    if isinstance(grad, DTensor):
        shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_shard())
        return grad.to_local(), world.world_size() // shards
    return grad, world.world_size()


def _abs_max(values: Tensor) -> float:
    return float(values.abs().max()) if values.numel() else 0.0


def _max_over_ranks(worst: float) -> float:
    """The largest of every rank's ``worst``, NaN when any is NaN (collective)."""
    both = torch.tensor([math.inf if math.isnan(worst) else worst, float(math.isnan(worst))], dtype=torch.float64)
    largest, any_nan = world.all_reduce_max(both).tolist()
    return math.nan if any_nan else largest


def grad_norm(grads: Grads) -> float:
    """The L2 norm over every entry, in float64: each rank's shards summed, every entry once (collective)."""
    local = 0.0
    for grad in grads.values():
        values, copies = _held(grad)
        local += float(values.double().square().sum()) / copies
    return float(world.all_reduce_sum(torch.tensor([local], dtype=torch.float64))[0]) ** 0.5


def grad_max_diff(grads: Grads, reference: Grads) -> float:
    """The largest absolute difference over every gradient entry (a parameter missing on one side counts whole);
    shard against shard, collective."""
    worst = 0.0
    for name in sorted(set(grads) | set(reference)):
        got, want = grads.get(name), reference.get(name)
        if got is None or want is None:
            worst = worst_of(worst, _abs_max(_held(got if got is not None else want)[0]))
            continue
        worst = worst_of(worst, _abs_max(_held(got)[0].double() - _held(want)[0].double()))
    return _max_over_ranks(worst)


def grad_max_abs(grads: Grads) -> float:
    """The largest absolute gradient entry (collective)."""
    worst = 0.0
    for grad in grads.values():
        worst = worst_of(worst, _abs_max(_held(grad)[0]))
    return _max_over_ranks(worst)


def token_mean_grad_norm(part: Part, ctx: Context) -> Optional[float]:
    """The gradient norm of the same batch under token-mean (one pack), for the gradient-scale report."""
    settings = dataclasses.replace(part.settings, agg_mode="token-mean")
    _fresh(part)
    run_packs(dataclasses.replace(part, settings=settings), ctx.full,
              plan_packs(ctx.full.lengths(), sum(ctx.full.lengths())), ctx.norms, ctx)
    return grad_norm(held_grads(part.model))

