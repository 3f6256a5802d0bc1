"""Worker: the PPO train step on FSDP2 ranks against an independent single-process reference.

The reference is the plain transformers model (same seed) on the whole global batch in the padded layout, with full
logits, a plain log-softmax and the numerics' padded `agg_loss` (dp_size 1). The ranks run the product path: the
sequences split unevenly over ranks, packed micro-batches under a small token budget (so at least two per rank),
the fused chunked loss, global normalisers and FSDP2's mean over ranks. For every agg mode and every variant
(plain, activation checkpointing, reshard_after_forward off, bf16 params with fp32 reduce) each rank writes the
largest gradient and updated-weight differences, relative to the largest reference entry, to <out>/rank<r>.json.

Legend: _BL padded [batch, length].
"""

from __future__ import annotations

import warnings

import torch

from fsdptrain.distributed import world
from tests.dist.workers.report import dist_worker, option
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets, ValueLossSettings
from fsdptrain.train.pack_losses import packed_policy_loss, packed_value_loss
from fsdptrain.rl.policy_loss import entropy_from_logits, policy_loss
from fsdptrain.rl.value_loss import value_loss
from fsdptrain.distributed.fsdp import build_policy, build_value_model, gather_full_grads, gather_full_state_dict
from fsdptrain.model.loading import build_full_model
from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
from fsdptrain.train.step import MiniBatch, accumulate_gradients, global_normalizers, optimizer_step
from tests.helpers.attention_call_counts import call_counts, reset_call_counts

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

VOCAB = 40
CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "tie_word_embeddings": True}
POLICY_SEED, VALUE_SEED = 5, 6
NUM_SEQS = 7  # rank r of 2 gets the sequences i with i % 2 == r: 4 and 3
TOKEN_BUDGET = 24
LR = 1e-2
LOSS_SCALE_FACTOR = 6.0
SETTINGS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, seq_level_ratio=False, kl_coef=0.1,
                kl_estimator="k3", entropy_coef=0.01, temperature=0.8, chunk_size=7, use_reference=True)


def global_batch():
    gen = torch.Generator().manual_seed(0)
    prompts, responses, targets = [], [], []
    for i in range(NUM_SEQS):
        p = int(torch.randint(1, 6, (), generator=gen))
        r = int(torch.randint(1, 9, (), generator=gen))
        prompts.append(torch.randint(0, VOCAB, (p,), generator=gen).tolist())
        responses.append(torch.randint(0, VOCAB, (r,), generator=gen).tolist())
        targets.append(SeqTargets(
            old_logprobs=-3.5 + 0.5 * torch.randn(r, generator=gen),
            advantages=torch.randn(r, generator=gen),
            ref_logprobs=-3.5 + 0.5 * torch.randn(r, generator=gen),
            old_values=torch.randn(r, generator=gen),
            returns=torch.randn(r, generator=gen),
        ))
    return prompts, responses, targets


def padded(prompts, responses, targets):
    """Right-padded [B, L] ids and attention mask; response-aligned targets at the positions that score them."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1, dtype=torch.bool)
    fields = {name: torch.zeros(len(prompts), width - 1) for name in
              ("old_logprobs", "advantages", "ref_logprobs", "old_values", "returns")}
    for b, (p, r, t) in enumerate(zip(prompts, responses, targets)):
        n = len(p) + len(r)
        ids[b, :n] = torch.tensor(p + r)
        attn[b, :n] = 1
        mask[b, len(p) - 1: n - 1] = True
        for name, store in fields.items():
            store[b, len(p) - 1: n - 1] = getattr(t, name)
    return ids, attn, mask, fields


def reference_grads_and_weights(kind: str, mode: str, batch, norms_counts):
    """The plain model on the whole padded batch: gradients, then the weights before and after one AdamW step."""
    model = build_full_model("policy" if kind == "policy" else "value", path=None, config=CONFIG,
                             seed=POLICY_SEED if kind == "policy" else VALUE_SEED)
    return reference_step(model, kind, mode, batch, norms_counts)


def reference_step(model, kind: str, mode: str, batch, norms_counts):
    """`reference_grads_and_weights` of a given plain ``model`` (a peft model too: its trainable parameters)."""
    prompts, responses, targets = batch
    ids, attn, mask, f = padded(prompts, responses, targets)
    norms = LossNormalizers(global_num_tokens=norms_counts[0], global_num_seqs=norms_counts[1], dp_size=1,
                            loss_scale_factor=LOSS_SCALE_FACTOR)
    out = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    if kind == "policy":
        logits = out[:, :-1].float() / SETTINGS["temperature"]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss, _ = policy_loss(logp, f["old_logprobs"], f["advantages"], mask, norms=norms,
                              settings=PolicyLossSettings(agg_mode=mode, clip_ratio_low=SETTINGS["clip_ratio_low"],
                                                          clip_ratio_high=SETTINGS["clip_ratio_high"],
                                                          clip_ratio_c=SETTINGS["clip_ratio_c"],
                                                          kl_coef=SETTINGS["kl_coef"],
                                                          kl_estimator=SETTINGS["kl_estimator"],
                                                          entropy_coef=SETTINGS["entropy_coef"], use_reference=True),
                              ref_logprobs=f["ref_logprobs"], entropy=entropy_from_logits(logits))
    else:
        values = out[:, :-1, 0].float()
        loss, _ = value_loss(values, f["old_values"], f["returns"], mask, norms=norms, agg_mode=mode,
                             cliprange_value=0.2)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    before = {n: v.detach().clone() for n, v in model.state_dict().items()}
    optimizer = build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)
    optimizer.step()
    return grads, before, {n: v.detach().clone() for n, v in model.state_dict().items()}


def update_relative_error(before: dict, after: dict, ref_before: dict, ref_after: dict) -> float:
    """||update - reference update|| / ||reference update|| over all weights (L2): 1.0 exactly if no step was taken."""
    num = sum(((after[n].float() - before[n].float()) - (ref_after[n] - ref_before[n])).pow(2).sum() for n in ref_after)
    den = sum((ref_after[n] - ref_before[n]).pow(2).sum() for n in ref_after)
    return float((num / den).sqrt())


def worst_relative(got: dict, want: dict) -> float:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    scale = max(v.abs().max().item() for v in want.values())
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want) / scale


def run_variant(kind: str, mode: str, variant: str, info, mesh, batch, references) -> dict:
    prompts, responses, targets = batch
    mine = [i for i in range(NUM_SEQS) if i % info.world_size == info.rank]
    mini = MiniBatch([prompts[i] for i in mine], [responses[i] for i in mine], [targets[i] for i in mine])
    options = dict(activation_checkpointing=variant == "checkpointing", reshard_after_forward=variant != "no_reshard",
                   param_dtype=torch.bfloat16 if variant == "bf16" else torch.float32, reduce_dtype=torch.float32)
    if kind == "policy":
        model = build_policy(path=None, config=CONFIG, seed=POLICY_SEED, mesh=mesh, **options)
        loss_fn, settings = packed_policy_loss, PolicyLossSettings(agg_mode=mode, **SETTINGS)
    else:
        model = build_value_model(path=None, config=CONFIG, seed=VALUE_SEED, mesh=mesh, **options)
        loss_fn, settings = packed_value_loss, ValueLossSettings(agg_mode=mode, cliprange_value=0.2)
    set_attention(model, "sdpa_segments")
    norms = global_normalizers(mini, dp_size=world.dp_size(mesh), loss_scale_factor=LOSS_SCALE_FACTOR)
    reset_call_counts()
    forwards = {"n": 0}
    model.register_forward_hook(lambda *_: forwards.__setitem__("n", forwards["n"] + 1))
    accumulate_gradients(model, mini, loss_fn=loss_fn, settings=settings, norms=norms, token_budget=TOKEN_BUDGET,
                         device=info.device)
    grads = gather_full_grads(model)
    before = gather_full_state_dict(model, rank0_only=False)
    optimizer = build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)
    optimizer_step(model, optimizer, grad_clip=0.0, guard=NonFiniteGuard(3))
    weights = gather_full_state_dict(model, rank0_only=False)
    ref_grads, ref_before, ref_weights = references[(kind, mode)]
    return {
        "grad_rel": worst_relative(grads, ref_grads),
        "weight_rel": worst_relative(weights, ref_weights),
        "update_rel": update_relative_error(before, weights, ref_before, ref_weights),
        "forwards": forwards["n"],
        "packed_calls": call_counts().get("sdpa_segments", 0),
        "num_local_seqs": len(mine),
        "norms": [norms.global_num_tokens, norms.global_num_seqs, norms.dp_size],
    }


@dist_worker(option("--variants", default="plain"), option("--modes", default=",".join(AGG_MODES)),
             option("--replicate", type=int, default=1), traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = {}
    mesh = world.build_mesh(dp_replicate=args.replicate, dp_shard=None, device_type="cpu")
    batch = global_batch()
    counts = (sum(len(r) for r in batch[1]), NUM_SEQS)
    modes = args.modes.split(",")
    references = {(kind, mode): reference_grads_and_weights(kind, mode, batch, counts)
                  for kind in ("policy", "value") for mode in modes}
    for variant in args.variants.split(","):
        for kind in ("policy", "value"):
            for mode in modes:
                out["results"][f"{variant}/{kind}/{mode}"] = run_variant(kind, mode, variant, info, mesh, batch,
                                                                        references)


if __name__ == "__main__":
    main()
