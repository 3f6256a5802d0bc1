"""Two ranks: check-metrics' gradient statistics on the gradients as each rank holds them (``held_grads``: FSDP2's
shards, never gathered; fsdptrain/check/layouts.py) against the same numbers computed directly from the gathered
whole gradients (``gather_full_grads``), for an FSDP mesh with unevenly sharded parameters (vocabulary 41 over 2
ranks) and an HSDP mesh (every shard on both ranks), and a NaN in one rank's shard. Each rank writes its numbers."""

from __future__ import annotations

import math

import torch

from fsdptrain.check.layouts import grad_max_abs, grad_max_diff, grad_norm
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import build_policy, gather_full_grads, held_grads, zero_grads
from tests.dist.workers.report import dist_worker

CONFIG = {"model_type": "llama", "vocab_size": 41, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": True}


def backward(policy, ids: torch.Tensor, power: int):
    zero_grads(policy)
    policy(input_ids=ids).logits.pow(power).mean().backward()
    return held_grads(policy), gather_full_grads(policy)


def direct(first: dict, second: dict) -> dict[str, float]:
    """The statistics from the whole gradients, written out."""
    return {"norm": math.sqrt(sum(float(g.double().square().sum()) for g in first.values())),
            "max_abs": max(float(g.abs().max()) for g in first.values()),
            "max_diff": max(float((second[n] - first[n]).abs().max()) for n in first)}


def record_for(mesh, ids: torch.Tensor) -> dict:
    policy = build_policy(path=None, config=CONFIG, seed=3, mesh=mesh, param_dtype=torch.float64,
                          reduce_dtype=torch.float64)
    held_a, whole_a = backward(policy, ids, 2)
    held_b, whole_b = backward(policy, ids, 3)
    want = direct(whole_a, whole_b)
    got = {"norm": grad_norm(held_a), "max_abs": grad_max_abs(held_a), "max_diff": grad_max_diff(held_b, held_a)}
    out = {f"{k}/relative_error": abs(got[k] - want[k]) / want[k] for k in want}
    out["sharded"] = [list(g.to_local().shape) for g in held_a.values()] != [list(g.shape) for g in whole_a.values()]
    local = held_b["model.embed_tokens.weight"].to_local()
    if world.rank() == 1 and local.numel():
        local.view(-1)[0] = math.nan
    out["nan_max_diff_is_nan"] = math.isnan(grad_max_diff(held_b, held_a))
    out["nan_norm_is_nan"] = math.isnan(grad_norm(held_b))
    return out


@dist_worker()
def main(args, info, record: dict) -> None:
    ids = torch.arange(0, 11)[None] % CONFIG["vocab_size"]  # the same batch on both ranks
    for name, replicate, shard in (("fsdp", 1, None), ("hsdp", 2, 1)):
        mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type="cpu")
        record.update({f"{name}/{k}": v for k, v in record_for(mesh, ids).items()})


if __name__ == "__main__":
    main()
