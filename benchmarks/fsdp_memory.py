"""FSDP2 per-rank training state (parameters + gradients + AdamW state) at N gloo ranks vs 1 (docs/performance.md).
Not a test.

    PYTHONPATH=. python benchmarks/fsdp_memory.py [--hidden 256 --layers 4 --vocab 8192] [--lora-r 16]
        [--param-dtype bfloat16] [--kl-reference]

Counts the bytes of the local shards after one optimizer step (exact, not RSS: the host's allocator would blur it).
``--kl-reference`` adds what a KL term costs: full fine-tuning's frozen sharded reference copy (stored in the param
dtype), nothing under LoRA (the reference is the policy with its adapters off, docs/lora.md).
"""

from __future__ import annotations

import argparse
import json

import torch


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA adapters of this rank (alpha 2r) on all-linear")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kl-reference", action="store_true", help="count the KL reference too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_config(*, hidden: int, layers: int, vocab: int) -> dict:
    """The measured model (the benchmark's medium model by default): qwen2 (q, k, v biases), untied head."""
    from fsdptrain.model.loading import TINY_CONFIG

    return {**TINY_CONFIG, "model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": 8,
            "num_key_value_heads": 4, "tie_word_embeddings": False}


def worker(args) -> None:
    from fsdptrain.distributed import world
    from fsdptrain.distributed.fsdp import build_policy, build_reference_model
    from fsdptrain.train.optim import build_optimizer

    torch.set_num_threads(1)
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    config = model_config(hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    lora = None
    if args.lora_r > 0:
        from fsdptrain.model.lora import LoraSettings

        lora = LoraSettings(r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0)
    model = build_policy(path=None, config=config, seed=0, mesh=mesh, lora=lora,
                         param_dtype=getattr(torch, args.param_dtype))
    optimizer = build_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
    ids = torch.randint(0, args.vocab, (1, 64))
    model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    optimizer.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    reference = 0
    if args.kl_reference and lora is None:  # under LoRA the reference is the policy itself
        ref = build_reference_model(path=None, config=config, seed=0, mesh=mesh,
                                    param_dtype=getattr(torch, args.param_dtype))
        reference = sum(_local_bytes(p) for p in ref.parameters())
    total = world.all_reduce_max(torch.tensor([float(params + grads + state + reference)], dtype=torch.float64))
    if info.is_main:
        print(json.dumps({"max_rank_bytes": float(total[0]), "params": params, "grads": grads, "state": state,
                          "reference": reference}))
    world.destroy_distributed()
    world.exit_process(0)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return {}
    from benchmarks.dist_util import launch

    flags = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab), "--lora-r",
             str(args.lora_r), "--param-dtype", args.param_dtype] + (["--kl-reference"] if args.kl_reference else [])
    one, many = launch(__file__, 1, flags), launch(__file__, args.nproc, flags)
    ratio = many["max_rank_bytes"] / one["max_rank_bytes"]
    print(f"per-rank params+grads+AdamW: 1 rank {one['max_rank_bytes'] / 2**20:.1f} MiB, {args.nproc} ranks "
          f"{many['max_rank_bytes'] / 2**20:.1f} MiB (largest rank): ratio {ratio:.3f}")
    return {"one": one, "many": many, "ratio": ratio}


if __name__ == "__main__":
    main()
