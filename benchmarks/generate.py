"""Generation tokens/s at 2 gloo ranks: the policy gathered once per ``generate`` call vs FSDP2's per-layer
all-gather in every decoded token's forward (docs/performance.md). Not a test.

    PYTHONPATH=. python benchmarks/generate.py [--hidden 256 --layers 4 --new-tokens 32 --prompts 8]

Both modes run on the same sharded model, interleaved, after a warm-up; the tokens they produce are compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args) -> None:
    from fsdptrain.data.tokenizer import load_bundled_tokenizer
    from fsdptrain.distributed import world
    from fsdptrain.distributed.fsdp import build_policy
    from fsdptrain.generation.gather import gathered_weights
    from fsdptrain.model.attention_switch import generation_attention
    from fsdptrain.model.loading import TINY_CONFIG
    from fsdptrain.generation.generate import generate_responses

    torch.set_num_threads(1)
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    tokenizer = load_bundled_tokenizer()
    config = {**TINY_CONFIG, "vocab_size": len(tokenizer), "hidden_size": args.hidden,
              "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 8,
              "num_key_value_heads": 4, "eos_token_id": None, "pad_token_id": tokenizer.pad_token_id}
    model = build_policy(path=None, config=config, seed=0, mesh=mesh)
    prompts = [f"{i} + {i} = {2 * i} ; repeat" for i in range(args.prompts)]
    times, tokens = {"per_token": [], "gathered": []}, {}
    for repeat in range(args.repeats + 1):
        for mode in ("per_token", "gathered"):
            start = time.perf_counter()
            with generation_attention(model), gathered_weights(model, enabled=mode == "gathered",
                                                               reshard_after_forward=True):
                out = generate_responses(model, tokenizer, prompts, max_new_tokens=args.new_tokens, temperature=1.0,
                                         top_p=1.0, do_sample=True, generator_seed=7, device=torch.device("cpu"))
            elapsed = time.perf_counter() - start
            tokens[mode] = [r for _, r, _ in out]
            if repeat > 0:
                times[mode].append(elapsed)
    generated = sum(len(r) for r in tokens["gathered"]) * info.world_size
    result = {mode: generated / statistics.median(t) for mode, t in times.items()}
    result["same_tokens"] = tokens["gathered"] == tokens["per_token"]
    result["ratio"] = result["gathered"] / result["per_token"]
    if info.is_main:
        print(json.dumps(result), flush=True)
    world.destroy_distributed()
    world.exit_process(0)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return {}
    from benchmarks.dist_util import launch

    flags = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--prompts", str(args.prompts),
             "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    result = launch(__file__, args.nproc, flags)
    print(f"generation at {args.nproc} ranks, {args.prompts} prompts x {args.new_tokens} new tokens per rank: "
          f"per-token gathers {result['per_token']:.0f} tok/s, gathered once {result['gathered']:.0f} tok/s, "
          f"ratio {result['ratio']:.2f}x, same tokens: {result['same_tokens']}")
    return result


if __name__ == "__main__":
    main()
