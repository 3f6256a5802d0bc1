"""``fsdptrain check-metrics`` on an ``fsdptrain sft`` config (``data=sft``; docs/sft.md, docs/check-metrics.md).

The first mini-batch of the run's first step (the rows ``fsdptrain sft`` would train on first) goes through every
layout of :func:`fsdptrain.check.layouts.layouts` (per-sequence, padded, packed under the configured and the
smallest budget, 1, 2 and one-sequence micro-batches, a simulated data-parallel size, the real ranks) with the SFT
loss, forward and backward, no optimizer step; each layout's loss, gradient (largest entry difference, the
trainer's logged norm and clip) and every non-DIAGNOSTIC metric are compared with a reference written out from the
definition: each sequence alone through the unpacked model, ``torch.nn.functional.cross_entropy`` per token on the
trained tokens, aggregated by hand per ``loss.agg_mode`` with the mini-batch's own counts.
"""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from fsdptrain.check.compare import Outcome, compare, describe_error, raised, rows, self_checks
from fsdptrain.check.layouts import (
    CLIP_PROBE,
    Context,
    Part,
    _padded_forward,
    grad_max_abs,
    grad_max_diff,
    grad_norm,
    layouts,
    trainer_clip,
)
from fsdptrain.check.moe_reference import DirectMoe, reference_moe_norms
from fsdptrain.check.per_sequence import sequence_moe_terms, sequence_outputs
from fsdptrain.check.precision import checked_precision, in_checked_precision, tolerances
from fsdptrain.check.report import CheckReport, GradScale, add_columns, exit_code, row_cells, write_report_json
from fsdptrain.config import validate_world
from fsdptrain.data.packing import pad_sequences
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import held_grads, reset_after_error, zero_grads
from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.model.moe import routing
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.grad_scale import grad_scale_report
from fsdptrain.metrics.typed import comparable, merge_all
from fsdptrain.rl.moe_aux_loss import MoeNormalizers
from fsdptrain.rl.sft_loss import sft_loss
from fsdptrain.data.epoch_order import EpochOrder
from fsdptrain.train import pack_losses
from fsdptrain.train.setup import build_policy_model, moe_aux_coef, resolve_device_type
from fsdptrain.model.loading import build_tokenizer
from fsdptrain.train.pack_losses import packed_sft_loss, SftLossSettings
from fsdptrain.train.sft import as_minibatch, load_sft_rows, sft_loss_scale_factor
from fsdptrain.train.step import MiniBatch

PREFIX = "sft/"


def per_sequence_sft_loss(model, prompts, responses, targets, *, norms: LossNormalizers,
                          settings: SftLossSettings) -> tuple[Tensor, object]:
    """The product's per-sequence path: each sequence alone through the unpacked model (full logits, plain
    log-softmax), its SFT loss with the mini-batch's global normalisers, summed."""
    total, collected = None, []
    for prompt_ids, response_ids, target in zip(prompts, responses, targets):
        logprobs_R, _, routes = sequence_outputs(model, prompt_ids, response_ids, temperature=1.0,
                                                 record=norms.moe is not None)
        loss, metrics = sft_loss(logprobs_R[None], target.response_mask[None].to(logprobs_R.device), norms=norms,
                                 agg_mode=settings.agg_mode)
        if norms.moe is not None:  # an MoE policy: each sequence's share of the load-balancing loss (docs/moe.md)
            aux, aux_metrics = sequence_moe_terms(routes, norms.moe, dp_size=norms.dp_size)
            loss, metrics = loss + aux.to(loss.dtype), metrics.merge(aux_metrics)
        total = loss if total is None else total + loss
        collected.append(metrics)
    return total, merge_all(collected)


def padded_sft_loss(model, prompts, responses, targets, *, norms: LossNormalizers,
                    settings: SftLossSettings) -> tuple[Tensor, object]:
    """The SFT loss of the whole batch as one right-padded ``[B, L]`` forward and the padded ``agg_loss``."""
    device = next(model.parameters()).device
    batch = pad_sequences(prompts, responses, response_masks=[t.response_mask for t in targets])
    with routing(model, record=norms.moe is not None) as routes:
        logits_BLV = _padded_forward(model, batch, device).float()
    labels_BL = torch.where(batch.label_mask, batch.labels, torch.zeros_like(batch.labels)).to(device)
    logprobs_BL = torch.log_softmax(logits_BLV, dim=-1).gather(-1, labels_BL[..., None])[..., 0]
    loss, metrics = sft_loss(logprobs_BL, batch.response_mask.to(device), norms=norms, agg_mode=settings.agg_mode)
    return pack_losses.with_moe_terms(loss, metrics, routes, batch, norms)


def reference_sft(model, batch: MiniBatch, mode: str, loss_scale_factor: float,
                  moe: Optional[MoeNormalizers] = None) -> tuple[Tensor, dict[str, float]]:
    """The loss from its definition: per sequence, ``cross_entropy(logits[t], token[t + 1])`` at the trained tokens
    (the demonstration's mask), then the mode's reduction written out with this batch's counts: token-mean divides
    the sum by the trained tokens N, token-sum by nothing, seq-mean-token-sum by the sequences with a trained token
    S (and by ``loss_scale_factor`` for -norm), seq-mean-token-mean averages each sequence's mean over S. An MoE
    policy (``moe``: the batch's load-balancing counts) adds each sequence's share of that loss to the returned
    scalar, and the MoE metrics computed directly (`fsdptrain.check.moe_reference.DirectMoe`)."""
    device = next(model.parameters()).device
    sums, counts, direct, aux = [], [], DirectMoe(moe), 0.0
    for prompt, response, target in zip(batch.prompts, batch.responses, batch.targets):
        ids = torch.tensor([prompt + response], device=device)
        with generation_attention(model), routing(model, record=moe is not None) as routes:
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        if moe is not None:
            aux = aux + direct.share(routes)
        nll = torch.nn.functional.cross_entropy(logits[len(prompt) - 1:-1], ids[0, len(prompt):], reduction="none")
        trained = target.response_mask.to(device)
        sums.append(nll[trained].sum())
        counts.append(int(trained.sum()))
    num_tokens, num_seqs = sum(counts), sum(1 for c in counts if c > 0)
    total = torch.stack(sums).sum()
    loss = {"token-mean": total / max(num_tokens, 1), "token-sum": total,
            "seq-mean-token-sum": total / max(num_seqs, 1),
            "seq-mean-token-sum-norm": total / max(num_seqs, 1) / loss_scale_factor,
            "seq-mean-token-mean": sum(s / c for s, c in zip(sums, counts) if c > 0) / max(num_seqs, 1)}[mode]
    values = {PREFIX + "loss": float(loss.detach()), PREFIX + "nll": float(total.detach()) / max(num_tokens, 1)}
    values.update({PREFIX + name: value for name, value in direct.metrics().items()})
    return loss + aux, values


def checked_batch(cfg: DictConfig, tokenizer) -> MiniBatch:
    """The rows of the first mini-batch of the run's first step, in its epoch order."""
    rows, _ = load_sft_rows(cfg, tokenizer)
    positions = EpochOrder(len(rows), seed=cfg.data.seed).take(cfg.sft.rows_per_step)
    first = positions[:cfg.sft.rows_per_step // cfg.trainer.mini_batches_per_step]
    return as_minibatch([rows[p] for p in first])


def _run(name: str, run_layout, part: Part, ctx: Context, ref_grads) -> Outcome:
    """One layout: its backward's loss, the loss metrics, the gradient difference, the trainer's norm and clip."""
    try:
        result = run_layout(part, ctx)
        values = {PREFIX + "backward_loss": result.loss, PREFIX + "grad_max_diff": grad_max_diff(result.grads, ref_grads)}
        values[PREFIX + "grad_norm"], values[PREFIX + "clip_coef"] = trainer_clip(
            part, result.grads, CLIP_PROBE * grad_norm(ref_grads))
        values.update({PREFIX + k: v for k, v in result.values().items()})
        return Outcome(name, values, {PREFIX + k: v for k, v in comparable(result.metrics).items()}, (PREFIX,))
    except Exception as error:  # a crashing layout is a failure of that layout, the others still run
        reset_after_error(part.model)
        return Outcome(name, {}, covers=(), error=describe_error(error))


def run_sft_checks(cfg: DictConfig, policy, batch: MiniBatch, mesh, device) -> CheckReport:
    """The reference and every layout, compared (collective)."""
    mode = cfg.loss.agg_mode
    lsf = sft_loss_scale_factor(cfg)
    settings = SftLossSettings(agg_mode=mode, chunk_size=cfg.loss.logprob_chunk_size)
    coef = moe_aux_coef(cfg, policy)
    moe = None if coef is None else reference_moe_norms(policy, batch, coef)
    part = Part(PREFIX, policy, settings, packed_sft_loss, per_sequence_sft_loss, padded_sft_loss, moe_coef=coef)
    counted = batch.num_counted_tokens()
    norms = LossNormalizers(sum(counted), sum(1 for c in counted if c > 0), dp_size=1, loss_scale_factor=lsf, moe=moe)
    rank, size = world.rank(), world.world_size()
    local = MiniBatch(*([getattr(batch, f)[i] for i in range(batch.num_seqs) if i % size == rank]
                        for f in ("prompts", "responses", "targets")))
    ctx = Context(full=batch, local=local, norms=norms, token_budget=cfg.trainer.token_budget,
                  simulated_dp=max(2, cfg.check.simulated_dp), mesh=mesh, device=device)
    tol = dict(rtol=cfg.check.rtol, atol=cfg.check.atol)
    zero_grads(policy)
    loss, values = reference_sft(policy, batch, mode, lsf, moe)
    loss.backward()
    ref_grads = held_grads(policy)
    values[PREFIX + "backward_loss"] = float(loss.detach())
    values[PREFIX + "grad_norm"] = norm = grad_norm(ref_grads)
    values[PREFIX + "clip_coef"] = min(1.0, CLIP_PROBE * norm / (norm + 1e-6)) if norm > 0 else 1.0
    values[PREFIX + "grad_max_diff"] = 0.0
    reference = Outcome("reference", values, covers=())
    scales = {PREFIX + "grad_max_diff": grad_max_abs(ref_grads)}
    planned = layouts(batch, token_budget=ctx.token_budget, simulated_dp_size=ctx.simulated_dp, world_size=size)
    comparisons, checks = [], []
    for name, run_layout in planned:
        try:
            outcome = _run(name, run_layout, part, ctx, ref_grads)
            comparisons += compare(reference, outcome, scales=scales, **tol)
            checks += self_checks(outcome, on_policy=False, **tol)
        except Exception as error:  # a comparison that cannot run is one FAIL row
            comparisons.append(raised(f"({name} raised)", name, error))
    report = grad_scale_report(mode, num_tokens=norms.global_num_tokens, num_seqs=norms.global_num_seqs,
                               seq_lengths=[c for c in counted], dp_size=size, loss_scale_factor=lsf,
                               grad_clip=cfg.trainer.grad_clip)
    notes = [] if norm > 0 else ["the gradient is zero on this batch: its comparisons prove nothing"]
    return CheckReport(mode, [n for n, _ in planned], reference, comparisons, checks, GradScale(report), notes)


def print_sft_report(report: CheckReport, cfg: DictConfig, batch: MiniBatch, world_size: int) -> None:
    """The table of every metric's worst layout and the verdict (rank 0)."""
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=160)
    console.print(f"check-metrics (fsdptrain sft): loss.agg_mode={report.mode}, {batch.num_seqs} demonstrations "
                  f"({sum(batch.num_counted_tokens())} trained tokens of {sum(batch.lengths())}) on {world_size} "
                  f"rank(s); rtol={cfg.check.rtol:g}, atol={cfg.check.atol:g}", highlight=False)
    console.print("layouts: " + ", ".join(report.layouts), highlight=False)
    table = Table(title=f"check-metrics: every layout against the reference ({report.mode})")
    add_columns(table)
    for row in rows(report.comparisons, report.reference):
        table.add_row(*row_cells(row))
    console.print(table)
    console.print("normalisation: " + report.grad_scale.report.describe(), highlight=False)
    for note in report.notes:
        console.print("note: " + note, highlight=False)
    for line in report.failures:
        console.print(line, style="red", highlight=False, markup=False)
    if report.failures:
        console.print(f"check-metrics: FAIL ({len(report.failures)} failure(s))", style="bold red")
    else:
        console.print(f"check-metrics: PASS ({len(report.comparisons)} comparisons, {len(report.checks)} checks)",
                      style="bold green")


def check_sft_metrics(cfg: DictConfig, *, json_path: Optional[str] = None) -> int:
    """``fsdptrain check-metrics`` on an SFT config, on this rank; the exit code (the same on every rank)."""
    info = world.init_distributed(device_type=resolve_device_type(cfg))
    replicate, shard = validate_world(cfg, info.world_size)
    mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type=info.device.type)
    cfg, notes = in_checked_precision(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), info.device)
    cfg.check.rtol, cfg.check.atol = tolerances(cfg)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = build_tokenizer(cfg)
    policy, _ = build_policy_model(cfg, tokenizer, mesh, info.device)
    batch = checked_batch(cfg, tokenizer)
    with checked_precision(cfg):
        report = run_sft_checks(cfg, policy, batch, mesh, info.device)
    report.notes += notes
    written = True
    if info.is_main:
        print_sft_report(report, cfg, batch, info.world_size)
        written = write_report_json(report, json_path)
    code = exit_code(failed=world.agree_max_int(0 if report.ok else 1) > 0,
                     unwritten=world.agree_max_int(0 if written else 1) > 0)
    world.destroy_distributed()
    return code
