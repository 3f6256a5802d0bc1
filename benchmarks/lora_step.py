"""The policy's update step with LoRA adapters vs full fine-tuning, on one process (docs/lora.md). Not a test.

    PYTHONPATH=. python benchmarks/lora_step.py [--hidden 256 --layers 4 --r 16 --seqs 16 --len 64]

One update = the trainer's `update_on_minibatch` on the plain (not sharded) medium model: packed forward, fused
PPO-clip loss, backward, clip, AdamW step. LoRA adds two thin matmuls per adapted linear in forward and backward but
drops the base weights' gradients (the backward still runs through them for the activations) and their AdamW update.
Each side runs one warm-up update, then --repeats timed ones, interleaved; the best process CPU time of each is
reported (the work, whatever else a shared machine runs).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fsdptrain.model.attention_switch import set_attention
    from fsdptrain.model.build import TINY_CONFIG, build_full_model
    from fsdptrain.model.lora import LoraSettings
    from fsdptrain.rl.packed_loss import PolicyLossSettings, SeqTargets
    from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
    from fsdptrain.train.step import MiniBatch, packed_policy_loss, update_on_minibatch

    config = {**TINY_CONFIG, "vocab_size": 512, "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4}
    gen = torch.Generator().manual_seed(0)
    prompt_len = args.len // 4
    prompts = [torch.randint(3, 512, (prompt_len,), generator=gen).tolist() for _ in range(args.seqs)]
    responses = [torch.randint(3, 512, (args.len - prompt_len,), generator=gen).tolist() for _ in range(args.seqs)]
    targets = [SeqTargets(old_logprobs=torch.full((len(r),), -6.0), advantages=torch.randn(len(r), generator=gen))
               for r in responses]
    batch = MiniBatch(prompts, responses, targets)
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                  seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
                                  temperature=1.0, chunk_size=1024)
    sides = {}
    for name, lora in (("full", None), ("lora", LoraSettings(r=args.r, alpha=2.0 * args.r, dropout=0.0))):
        model = build_full_model("policy", path=None, config=config, seed=0, lora=lora)
        set_attention(model, "sdpa_segments")
        sides[name] = (model, build_optimizer(model, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8))

    def update(name: str) -> float:
        model, optimizer = sides[name]
        start = time.process_time()
        update_on_minibatch(model, optimizer, batch, loss_fn=packed_policy_loss, settings=settings, dp_size=1,
                            loss_scale_factor=None, token_budget=2048, grad_clip=1.0, guard=NonFiniteGuard(3),
                            device=torch.device("cpu"))
        return time.process_time() - start

    best = {name: float("inf") for name in sides}
    for repeat in range(args.repeats + 1):
        for name in sides:
            seconds = update(name)
            if repeat > 0:  # the first is warm-up
                best[name] = min(best[name], seconds)
    result = {"full_s": best["full"], "lora_s": best["lora"], "ratio": best["lora"] / best["full"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
