"""Worker: context parallelism (cp = world size, one CP group) against the same fused packed loss in one process.

Every rank holds the whole mini-batch of tests/dist/workers/train_step_checks.py (7 sequences, packed under a
24-token budget into several rows, each padded to a multiple of 2 x cp; sequences cross the chunk boundaries). The
reference is the unsharded model (the same weights) on the same packs through `accumulate_gradients` with no CP and
dp_size 1. For every agg mode and every variant (plain, activation checkpointing, LoRA) each rank writes the largest
log-prob, gradient and metric differences to <out>/rank<r>.json; bf16 params (fp32 reduce), the policy in token-mean,
against the same fp32 reference.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdptrain.data.context_split import padded_length
from fsdptrain.data.packing import pack_sequences
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import plan_agreed, reduce_metrics
from fsdptrain.distributed.context_parallel import build_context_group, shard_row
from fsdptrain.distributed.fsdp import build_policy, build_value_model, gather_full_grads
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.loading import build_full_model
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import comparable, finalize
from fsdptrain.rl.fused_loss import ValueLossSettings
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.pack_losses import (
    context_token_outputs,
    packed_policy_loss,
    packed_value_loss,
    policy_token_outputs,
)
from fsdptrain.train.step import MiniBatch, accumulate_gradients, global_normalizers
from tests.dist.workers.lora_checks import LORA, nudged
from tests.dist.workers.report import dist_worker, option
from tests.dist.workers.train_step_checks import (
    CONFIG,
    LOSS_SCALE_FACTOR,
    POLICY_SEED,
    SETTINGS,
    TOKEN_BUDGET,
    VALUE_SEED,
    global_batch,
)

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def models(kind: str, variant: str, mesh):
    """(the unsharded reference, the sharded model with the same weights)."""
    seed = POLICY_SEED if kind == "policy" else VALUE_SEED
    lora = LORA if variant == "lora" else None
    reference = build_full_model(kind, path=None, config=CONFIG, seed=seed, lora=lora)
    if lora is not None:
        nudged(reference, seed + 100)
    build = build_policy if kind == "policy" else build_value_model
    model = build(path=None, config=CONFIG, seed=seed, mesh=mesh, lora=lora,
                  activation_checkpointing=variant == "checkpointing",
                  param_dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
    set_model_state_dict(model, dict(reference.state_dict()), options=StateDictOptions(full_state_dict=True))
    for m in (reference, model):
        set_attention(m, "sdpa_segments")
    return reference, model


def worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want)


def logprob_check(reference, model, batch, context) -> float:
    """Max |log-prob, entropy| difference of every pack: the CP forward against the one-process forward."""
    prompts, responses, _ = batch
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    plan = plan_agreed(lengths, TOKEN_BUDGET)
    diff, crossing = 0.0, 0
    with torch.no_grad():
        for pack in plan.packs:
            packed = pack_sequences(prompts, responses, pack, pad_to=padded_length(sum(lengths[i] for i in pack),
                                                                                    context.size))
            shard = shard_row(packed, context)
            crossing += sum(1 for piece in shard.split.pieces if piece.num_keys > piece.num_queries)
            want = policy_token_outputs(reference, packed, temperature=0.8, chunk_size=7)
            got = context_token_outputs(model, packed, shard, temperature=0.8, chunk_size=7)
            diff = max(diff, (got[0] - want[0]).abs().max().item(), (got[1] - want[1]).abs().max().item())
    return diff, crossing


def run(kind: str, mode: str, variant: str, mesh, context, batch) -> dict:
    prompts, responses, targets = batch
    mini = MiniBatch(prompts, responses, targets)
    reference, model = models(kind, variant, mesh)
    if kind == "policy":
        loss_fn, settings = packed_policy_loss, PolicyLossSettings(agg_mode=mode, **SETTINGS)
    else:
        loss_fn, settings = packed_value_loss, ValueLossSettings(agg_mode=mode, cliprange_value=0.2)
    counts = (sum(len(r) for r in responses), len(responses))
    ref_norms = LossNormalizers(global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=1,
                                loss_scale_factor=LOSS_SCALE_FACTOR)
    want = accumulate_gradients(reference, mini, loss_fn=loss_fn, settings=settings, norms=ref_norms,
                                token_budget=TOKEN_BUDGET, device=torch.device("cpu"))
    norms = global_normalizers(mini, dp_size=world.dp_size(mesh), loss_scale_factor=LOSS_SCALE_FACTOR,
                               context=context)
    got = accumulate_gradients(model, mini, loss_fn=loss_fn, settings=settings, norms=norms,
                               token_budget=TOKEN_BUDGET, device=torch.device("cpu"), context=context)
    ref_grads = {n.replace("base_model.model.", ""): p.grad for n, p in reference.named_parameters()
                 if p.grad is not None}
    grads = {n.replace("base_model.model.", ""): g for n, g in gather_full_grads(model).items()}
    reduced = reduce_metrics(got.metrics)
    want_metrics = {k: v for k, v in finalize(want.metrics).items() if k in comparable(want.metrics)}
    got_metrics = {k: v for k, v in finalize(reduced).items() if k in comparable(reduced)}
    out = {
        "grad_abs": worst(grads, ref_grads),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "num_grads": len(grads),
        "metric_names_equal": sorted(want_metrics) == sorted(got_metrics),
        "metric_rel": max(abs(got_metrics[k] - want_metrics[k]) / max(1.0, abs(want_metrics[k])) for k in want_metrics),
        "norms": [norms.global_num_tokens, norms.global_num_seqs, norms.dp_size],
        "ref_counts": list(counts),
    }
    if kind == "policy" and mode == AGG_MODES[0]:
        out["logprob_abs"], out["crossing_pieces"] = logprob_check(reference, model, batch, context)
    return out


@dist_worker(option("--variants", default="plain,checkpointing,lora,bf16"), traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = {}
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    context = build_context_group(info.world_size)
    batch = global_batch()
    for variant in args.variants.split(","):
        kinds = ((("policy", ("token-mean",)),) if variant == "bf16" else
                 (("policy", AGG_MODES), ("value", ("token-mean", "seq-mean-token-mean"))))
        for kind, modes in kinds:
            for mode in modes:
                out["results"][f"{variant}/{kind}/{mode}"] = run(kind, mode, variant, mesh, context, batch)


if __name__ == "__main__":
    main()
