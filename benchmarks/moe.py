"""A mixture-of-experts update step against a dense model of the same active parameters, on the CPU (docs/moe.md,
"Measured"). Not a test.

    PYTHONPATH=. python benchmarks/moe.py [--hidden 256 --layers 4 --experts 8 --top-k 2 --seqs 16 --length 128]

Three sides, each in its own process (one thread), the trainer's ``update_on_minibatch`` on the plain model (packed
forward, fused PPO-clip loss, backward, clip, AdamW step; token-mean) over one mini-batch of ``--seqs`` sequences of
``--length`` tokens:

- dense: Qwen3, MLP width ``top_k x moe_width``: per token the same multiply-adds in its MLP as the MoE's k experts;
- moe, aux off: Qwen3-MoE, ``--experts`` experts of width ``moe_width`` (``--hidden``), top-k, transformers' default
  experts kernel, ``model.moe.aux_loss_coef=0`` (the MoE metrics only);
- moe, aux on: the same with the load-balancing loss (coef 0.001): the update first counts the mini-batch's routes
  with a no-grad forward (`fsdptrain.train.step.moe_normalizers`), then adds each pack's share.

Tokens/s: the mini-batch's tokens over the best process CPU time of ``--repeats`` updates after one warm-up. Peak:
the process's resident set (ru_maxrss) above the set just before the first update, with glibc's mmap threshold fixed
at 64 KiB so freed tensors leave it (the live tensors' peak; see benchmarks/context_parallel.py); the weights,
gradients and AdamW moments are included (they are allocated in the first update), so the MoE's E / k times larger
MLP shows there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SIDES = ("dense", "moe, aux off", "moe, aux on")


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side", choices=SIDES, default=None, help="(internal) run one side in this process")
    return parser.parse_args(argv)


def model_of(args, side: str):
    """The side's model, fp32, weights from seed 0."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=args.hidden // 8, max_position_embeddings=4096,
                  tie_word_embeddings=True)
    torch.manual_seed(0)
    if side == "dense":
        return Qwen3ForCausalLM(Qwen3Config(intermediate_size=args.top_k * args.hidden, **common))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=args.experts, num_experts_per_tok=args.top_k,
                                              moe_intermediate_size=args.hidden, intermediate_size=args.hidden,
                                              norm_topk_prob=True, **common))


def run_side(args) -> dict:
    from benchmarks.lora import random_policy_batch
    from fsdptrain.model.attention_switch import set_attention
    from fsdptrain.model.loading import without_router_loss
    from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
    from fsdptrain.train.pack_losses import packed_policy_loss
    from fsdptrain.train.step import update_on_minibatch

    torch.set_num_threads(1)
    model = model_of(args, args.side)
    without_router_loss(model)
    set_attention(model, "sdpa_segments")
    optimizer = build_optimizer(model, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
    batch, settings = random_policy_batch(args.seqs, args.length)
    moe_coef = {"dense": None, "moe, aux off": 0.0, "moe, aux on": 0.001}[args.side]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = float("inf")
    for repeat in range(args.repeats + 1):
        start = time.process_time()
        update_on_minibatch(model, optimizer, batch, loss_fn=packed_policy_loss, settings=settings, dp_size=1,
                            loss_scale_factor=None, token_budget=args.seqs * args.length, grad_clip=1.0,
                            guard=NonFiniteGuard(3), device=torch.device("cpu"), moe_coef=moe_coef)
        if repeat > 0:  # the first is warm-up
            best = min(best, time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    total = sum(p.numel() for p in model.parameters())
    return {"side": args.side, "params": total, "tokens_per_s": args.seqs * args.length / best, "step_s": best,
            "peak_bytes": peak}


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    if args.side is not None:
        print(json.dumps(run_side(args)))
        return []
    flags = [f"--hidden={args.hidden}", f"--layers={args.layers}", f"--experts={args.experts}",
             f"--top-k={args.top_k}", f"--seqs={args.seqs}", f"--length={args.length}", f"--repeats={args.repeats}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = []
    for side in SIDES:
        done = subprocess.run([sys.executable, __file__, *flags, f"--side={side}"], env=env, capture_output=True,
                              text=True, check=True)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| side | parameters | tokens/s | step (CPU s) | peak above start |")
    print("| --- | --- | --- | --- | --- |")
    for row in out:
        print(f"| {row['side']} | {row['params'] / 1e6:.2f} M | {row['tokens_per_s']:.0f} | {row['step_s']:.2f} | "
              f"{row['peak_bytes'] / 2**20:.0f} MiB |")
    return out


if __name__ == "__main__":
    main()
