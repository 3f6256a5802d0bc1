"""Worker: expert parallelism (fsdptrain/distributed/expert_parallel.py) against the same run at ``parallel.ep=1``.

On 2 (or 4) gloo ranks a tiny Qwen3-MoE policy (4 experts, top-2, both layers sparse) is built twice from one seed,
at ep=1 (FSDP2 over every weight) and at ep=2 (each rank holds 2 experts; on 4 ranks FSDP2 also shards them over the
2 ranks that hold the same ones), and each runs the product's update on the same uneven split of a global batch:
packed micro-batches under a small token budget, the fused policy loss with global normalisers, FSDP2's reduction,
a clipped AdamW step. Each rank writes the loss, the reduced metrics, the grad norm and the largest differences of
every gathered gradient and updated weight, relative to the largest entry, to <out>/rank<r>.json; and the same for
the plain transformers model on the whole padded batch (tests/dist/workers/train_step_checks.py's reference).

Also: a forward with the experts gathered (what generation runs, ``experts_gathered``) against ep=1's forward, and
a config that ``ep`` does not divide or a dense model, each a one-line ConfigError.
"""

from __future__ import annotations

import warnings

import torch

from fsdptrain.config import ConfigError
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.distributed.expert_parallel import experts_gathered, is_expert_parallel
from fsdptrain.distributed.fsdp import build_policy, gather_full_grads, gather_full_state_dict
from fsdptrain.metrics.typed import finalize
from fsdptrain.model.attention_switch import generation_attention, set_attention
from fsdptrain.model.loading import build_full_model
from fsdptrain.rl.fused_loss import PolicyLossSettings
from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
from fsdptrain.train.pack_losses import packed_policy_loss
from fsdptrain.train.step import MiniBatch, accumulate_gradients, global_normalizers, optimizer_step
from tests.dist.workers.report import dist_worker, option
from tests.dist.workers.train_step_checks import CONFIG as DENSE_CONFIG
from tests.dist.workers.train_step_checks import (
    LOSS_SCALE_FACTOR,
    NUM_SEQS,
    SETTINGS,
    TOKEN_BUDGET,
    VOCAB,
    global_batch,
    reference_step,
    worst_relative,
)

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

CONFIG = {"model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True,
          "max_position_embeddings": 128, "output_router_logits": False, "tie_word_embeddings": True}
OTHER_ARCHITECTURES = {  # transformers' other MoE decoders: the same experts layout, another router and block
    "mixtral": {"model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 16,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
                "output_router_logits": False},
    "olmoe": {"model_type": "olmoe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "max_position_embeddings": 128, "output_router_logits": False},
}
SEED = 5
MODE = "seq-mean-token-sum-norm"  # the agg mode with both global counts and the loss scale factor
LR = 1e-2
GRAD_CLIP = 0.05  # far below the measured norm (1.73), so the clip scales every gradient by the global norm


def update(ep: int, info, mesh, batch, activation_checkpointing: bool = False) -> dict:
    """The product's update at ``ep``: loss, reduced metrics, grad norm, gathered gradients and weights."""
    prompts, responses, targets = batch
    mine = [i for i in range(NUM_SEQS) if i % info.world_size == info.rank]
    mini = MiniBatch([prompts[i] for i in mine], [responses[i] for i in mine], [targets[i] for i in mine])
    model = build_policy(path=None, config=CONFIG, seed=SEED, mesh=mesh, ep=ep,
                         activation_checkpointing=activation_checkpointing)
    assert is_expert_parallel(model) == (ep > 1)
    ids = torch.randint(0, VOCAB, (2, 5 + 3 * info.rank), generator=torch.Generator().manual_seed(info.rank))
    logits = forward_logits(model, ids)
    with experts_gathered(model, reshard_after_forward=True):
        gathered = forward_logits(model, ids)
    set_attention(model, "sdpa_segments")
    norms = global_normalizers(mini, dp_size=world.dp_size(mesh), loss_scale_factor=LOSS_SCALE_FACTOR)
    settings = PolicyLossSettings(agg_mode=MODE, **SETTINGS)
    done = accumulate_gradients(model, mini, loss_fn=packed_policy_loss, settings=settings, norms=norms,
                                token_budget=TOKEN_BUDGET, device=info.device)
    loss = world.all_reduce_sum(torch.tensor([done.loss], dtype=torch.float64))[0].item()
    grads = gather_full_grads(model)
    optimizer = build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)
    outcome = optimizer_step(model, optimizer, grad_clip=GRAD_CLIP, guard=NonFiniteGuard(3))
    metrics = finalize(reduce_metrics(done.metrics))
    local_experts = list(model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape)
    return {"local_experts": local_experts, "logits": logits, "gathered": gathered, "loss": loss, "metrics": metrics, "grad_norm": outcome.grad_norm, "grads": grads,
            "weights": gather_full_state_dict(model, rank0_only=False)}


def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A padded batch's logits, on the attention generation uses."""
    with torch.no_grad(), generation_attention(model):
        return model(input_ids=ids, use_cache=False).logits.float()


def forward_backward(config: dict, ep: int, info, mesh) -> tuple[float, dict]:
    """A padded batch's mean squared logit and its gathered gradients, the model built at ``ep``."""
    model = build_policy(path=None, config=config, seed=SEED, mesh=mesh, ep=ep)
    ids = torch.randint(0, VOCAB, (2, 6 + 3 * info.rank), generator=torch.Generator().manual_seed(info.rank))
    with generation_attention(model):
        loss = model(input_ids=ids, use_cache=False).logits.float().square().mean()
    loss.backward()
    return loss.item(), gather_full_grads(model)


def other_architectures(info, mesh, ep: int) -> dict:
    out = {}
    for name, config in OTHER_ARCHITECTURES.items():
        (loss_one, grads_one), (loss_split, grads_split) = (forward_backward(config, 1, info, mesh),
                                                            forward_backward(config, ep, info, mesh))
        out[name] = {"loss": [loss_one, loss_split], "grad_rel": worst_relative(grads_split, grads_one)}
    return out


def empty_exchanges(info, mesh, ep: int) -> dict:
    """The experts module called as its block calls it, at ep=1 and at ``ep``, with transformers' grouped_mm and
    eager implementations, where no row goes to some ranks' experts (every token chooses experts 0 and 1) and where a
    rank has no token at all: the outputs and the input gradients, largest absolute difference. (The eager loop
    returns zeros outside the graph for no rows: a rank that skipped the backward all-to-alls would hang its peers.)"""
    one, split = (build_policy(path=None, config=CONFIG, seed=SEED, mesh=mesh, ep=e) for e in (1, ep))
    one.model.layers[0].unshard()  # at ep=1 the experts are the layer unit's: gathered by its pre-forward otherwise
    gen = torch.Generator().manual_seed(info.rank)
    tokens = 0 if info.rank == 1 else 3
    cases = {"no_rows_to_some_experts": (3, [0, 1]), "no_tokens_on_rank_1": (tokens, [3, 0])}
    out = {}
    for implementation in ("grouped_mm", "eager"):
        for model in (one, split):
            model.config._experts_implementation = implementation
        for name, (num_tokens, chosen) in cases.items():
            hidden = torch.randn(num_tokens, CONFIG["hidden_size"], generator=gen)
            index = torch.tensor([chosen] * num_tokens, dtype=torch.long).reshape(num_tokens, 2)
            weights = torch.rand(num_tokens, 2, generator=gen)
            results = []
            for model in (one, split):
                leaf = hidden.clone().requires_grad_()
                output = model.model.layers[0].mlp.experts(leaf, index, weights)
                loss = output.square().sum()
                if loss.requires_grad or model is split:  # ep=1's eager loop on no token builds no graph
                    loss.backward()
                results.append((output.detach(), leaf.grad))
            (out_one, grad_one), (out_split, grad_split) = results
            out[f"{implementation}/{name}"] = {
                "shape": list(out_split.shape),
                "output": (out_split - out_one).abs().max().item() if num_tokens else 0.0,
                "grad": (grad_split - grad_one).abs().max().item() if num_tokens else 0.0}
    return out


def refusals(mesh) -> dict:
    out = {}
    for name, config, ep in (("dense", DENSE_CONFIG, 2), ("indivisible", {**CONFIG, "num_experts": 3}, 2)):
        try:
            build_policy(path=None, config=config, seed=SEED, mesh=mesh, ep=ep)
            out[name] = None
        except ConfigError as error:
            out[name] = str(error)
    return out


@dist_worker(option("--ep", type=int, default=2), traceback_in_record=True)
def main(args, info, record: dict) -> None:
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    batch = global_batch()
    one, split = update(1, info, mesh, batch), update(args.ep, info, mesh, batch)
    checkpointed = update(args.ep, info, mesh, batch, activation_checkpointing=True)
    reference = build_full_model("policy", path=None, config=CONFIG, seed=SEED)
    ref_grads, _, _ = reference_step(reference, "policy", MODE, batch, (sum(len(r) for r in batch[1]), NUM_SEQS))
    record["results"] = {
        "loss": [one["loss"], split["loss"], checkpointed["loss"]],
        "metrics": [one["metrics"], split["metrics"], checkpointed["metrics"]],
        "grad_norm": [one["grad_norm"], split["grad_norm"], checkpointed["grad_norm"]],
        "grad_rel": worst_relative(split["grads"], one["grads"]),
        "grad_rel_checkpointed": worst_relative(checkpointed["grads"], one["grads"]),
        "grad_rel_reference": worst_relative(split["grads"], ref_grads),
        "grad_rel_reference_ep1": worst_relative(one["grads"], ref_grads),
        "weight_rel": worst_relative(split["weights"], one["weights"]),
        "grad_names": sorted(split["grads"]),
        "dispatched_vs_ep1": (split["logits"] - one["logits"]).abs().max().item(),
        "gathered_vs_ep1": (split["gathered"] - one["logits"]).abs().max().item(),
        "local_experts": split["local_experts"],
        "refusals": refusals(mesh),
        "architectures": other_architectures(info, mesh, args.ep),
        "empty_exchanges": empty_exchanges(info, mesh, args.ep),
    }


if __name__ == "__main__":
    main()
