"""Generation with LoRA adapters kept separate vs merged into the weights, on one process (docs/lora.md). Not a test.

    PYTHONPATH=. python benchmarks/lora_generate.py [--hidden 256 --layers 4 --r 16 --prompts 32 --new-tokens 16]

With ``rollout.gather_weights`` the trainer generates from the gathered weights with the adapters separate (each
adapted linear adds two thin matmuls, x A^T B^T, per token). Merging W + (alpha / r) B A before generating (and
unmerging after) saves those matmuls but costs a pass over every adapted weight twice per step and changes the
rounding of the sampled model. This times both on the same unsharded model: CPU seconds of ``generate`` (the
process's work, steadier than wall time on a shared machine), best of ``--repeats``, plus one merge + unmerge.
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
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft.tuners.lora import LoraLayer

    from fsdptrain.model.build import TINY_CONFIG, build_full_model
    from fsdptrain.model.lora import LoraSettings

    config = {**TINY_CONFIG, "vocab_size": 512, "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4}
    model = build_full_model("policy", path=None, config=config, seed=0,
                             lora=LoraSettings(r=args.r, alpha=2.0 * args.r, dropout=0.0)).eval()
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    ids = torch.randint(3, 512, (args.prompts, 8), generator=torch.Generator().manual_seed(0))

    def generate() -> tuple[float, torch.Tensor]:
        best, out = float("inf"), None
        for _ in range(args.repeats):
            start = time.process_time()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
            best = min(best, time.process_time() - start)
        return best, out

    separate_s, separate = generate()
    start = time.process_time()
    for layer in layers:
        layer.merge()
    merge_s = time.process_time() - start
    merged_s, merged = generate()
    start = time.process_time()
    for layer in layers:
        layer.unmerge()
    merge_s += time.process_time() - start
    result = {"separate_s": separate_s, "merged_s": merged_s, "merge_unmerge_s": merge_s,
              "speedup_with_merge": separate_s / (merged_s + merge_s),
              "same_tokens": bool(torch.equal(separate, merged))}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
