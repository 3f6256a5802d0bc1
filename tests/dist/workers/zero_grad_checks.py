"""Two ranks, an FSDP2 policy: a backward, a no-grad forward (which leaves the root unit unsharded), then the same
backward again after zeroing the gradients, once through `zero_grads` and once through plain `module.zero_grad`.
Each rank writes whether the root was left unsharded, and how the two re-run gradients compare with the first."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import build_policy, gather_full_grads, zero_grads
from tests.dist.workers.report import dist_worker

CONFIG = {"model_type": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": True}


def backward(policy, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    policy(input_ids=ids).logits.float().square().mean().backward()
    return gather_full_grads(policy)


def largest_difference(got: dict, want: dict) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


@dist_worker()
def main(args, info, record: dict) -> None:
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    policy = build_policy(path=None, config=CONFIG, seed=3, mesh=mesh)
    ids = torch.arange(info.rank, info.rank + 9)[None] % CONFIG["vocab_size"]
    first = backward(policy, ids)
    for name, zero in (("zero_grads", zero_grads), ("module_zero_grad", lambda m: m.zero_grad(set_to_none=True))):
        with torch.no_grad():
            policy(input_ids=ids)
        record[f"{name}/root_left_unsharded"] = any(not isinstance(p, DTensor) for p in policy.parameters())
        zero(policy)
        record[f"{name}/largest_difference"] = largest_difference(backward(policy, ids), first)


if __name__ == "__main__":
    main()
