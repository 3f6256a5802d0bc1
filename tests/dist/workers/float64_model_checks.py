"""Two ranks, an FSDP2 policy built with float64 master weights (check-metrics' float64 mode): every rank's
non-persistent buffers (the rotary frequencies) and its logits on the same input, against rank 0's. Rank 0's full
model holds float32 buffers; broadcast into the other ranks' float64 buffers as they were, they arrived wrong."""

from __future__ import annotations

import torch

from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import build_policy, non_persistent_buffers
from tests.dist.workers.report import dist_worker

CONFIG = {"model_type": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": True}


@dist_worker()
def main(args, info, record: dict) -> None:
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    policy = build_policy(path=None, config=CONFIG, seed=3, mesh=mesh, param_dtype=torch.float64,
                          reduce_dtype=torch.float64)
    buffers = {name: buf.double() for name, buf in non_persistent_buffers(policy).items()}
    with torch.no_grad():
        logits = policy(input_ids=torch.arange(9)[None] % CONFIG["vocab_size"]).logits
    record.update({"buffer_dtypes": sorted({str(b.dtype) for b in non_persistent_buffers(policy).values()}),
                   "logits_dtype": str(logits.dtype)})
    for name, value in {**{f"buffer/{n}": b for n, b in buffers.items()}, "logits": logits}.items():
        from_rank0 = value.clone()
        torch.distributed.broadcast(from_rank0, src=0)
        record[f"{name}/largest_difference_to_rank0"] = float((value - from_rank0).abs().max())


if __name__ == "__main__":
    main()
