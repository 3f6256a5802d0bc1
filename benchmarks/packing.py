"""Packed vs padded forward+backward throughput on a skewed (log-normal) length mix. Not a test.

    PYTHONPATH=. python benchmarks/packing.py [--num-seqs 16] [--layers 2] ...

Both layouts run the same sequences through the same tiny Qwen2 (built from a config, random weights), with the
same loss (summed next-token log-probs over every real position), interleaved so machine noise hits both alike:
- padded: one right-padded batch [B, L_max] with an attention mask, on sdpa;
- packed: `plan_packs` under a token budget, one [1, T] row per pack, on `sdpa_segments` (or --backend).
Throughput counts real tokens only. The padding ceiling, padded tokens / real tokens, is the speed-up packing would
give if cost were linear in tokens; attention's quadratic part and fixed per-call costs move the measured ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from fsdptrain.data.packing import pack_sequences, pad_sequences, plan_packs
from fsdptrain.model.attention_switch import packed_attention, packed_model_inputs


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--median-len", type=int, default=160, help="median sequence length (log-normal)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma: the skew of the mix")
    parser.add_argument("--max-len", type=int, default=1536)
    parser.add_argument("--token-budget", type=int, default=2048, help="packed row budget (tokens)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each layout (after a warm-up)")
    parser.add_argument("--backend", default="auto", help="packed attention backend")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (0: torch's default); 1 is steadiest on a shared machine"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line at the end")
    return parser.parse_args()


def _lengths(args: argparse.Namespace) -> list[int]:
    gen = torch.Generator().manual_seed(args.seed)
    draws = torch.randn(args.num_seqs, generator=gen) * args.sigma + math.log(args.median_len)
    return [int(min(args.max_len, max(8, round(math.exp(x))))) for x in draws.tolist()]


def _summed_logprobs(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logprobs * mask).sum()


def main() -> None:
    args = _parse()
    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = _lengths(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(1, args.vocab, (max(1, n // 4),), generator=gen) for n in lengths]
    responses = [torch.randint(1, args.vocab, (n - max(1, n // 4),), generator=gen) for n in lengths]

    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=max(args.max_len, args.token_budget),
    )
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model.train()  # Qwen2's attention dropout is 0: train mode changes nothing but the autograd bookkeeping

    padded = pad_sequences(prompts, responses)
    plan = plan_packs(lengths, args.token_budget)
    packs = [pack_sequences(prompts, responses, idx) for idx in plan.packs]
    real_tokens = sum(lengths)
    padded_tokens = padded.input_ids.numel()

    def run_padded() -> None:
        out = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False)
        _summed_logprobs(out.logits, padded.labels, padded.label_mask).backward()

    def run_packed() -> None:
        with packed_attention(model, args.backend):
            for packed in packs:
                out = model(**packed_model_inputs(packed))
                _summed_logprobs(out.logits, packed.labels, packed.label_mask).backward()

    with packed_attention(model, args.backend) as backend_name:
        pass
    print("settings:")
    print(f"  model: Qwen2 hidden={args.hidden} layers={args.layers} heads={args.heads} vocab={args.vocab}, fp32, CPU "
          f"threads={torch.get_num_threads()}")
    print(f"  lengths: {args.num_seqs} log-normal (median {args.median_len}, sigma {args.sigma}, clipped to "
          f"[8, {args.max_len}], seed {args.seed}): {sorted(lengths)}")
    print(f"  padded: one batch [{padded.input_ids.shape[0]}, {padded.input_ids.shape[1]}] on sdpa with a mask")
    print(f"  packed: {plan.num_packs} pack(s) under a budget of {args.token_budget} tokens on {backend_name}, fill "
          f"{', '.join(f'{f:.2f}' for f in plan.fill_efficiency)}")
    print(f"  repeats: {args.repeats} timed after 1 warm-up, interleaved; forward+backward, grads zeroed between")

    timings: dict[str, list[float]] = {"padded": [], "packed": []}
    for repeat in range(args.repeats + 1):
        for name, fn in (("padded", run_padded), ("packed", run_packed)):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if repeat > 0:
                timings[name].append(elapsed)

    seconds = {name: statistics.median(values) for name, values in timings.items()}
    speed = {name: real_tokens / s for name, s in seconds.items()}
    print("results (median):")
    for name in ("padded", "packed"):
        print(f"  {name}: {seconds[name] * 1000:8.1f} ms   {speed[name]:10.0f} real tokens/s")
    print(f"  measured speed-up packed/padded: {speed['packed'] / speed['padded']:.2f}x   "
          f"padding ceiling (padded tokens / real tokens = {padded_tokens}/{real_tokens}): "
          f"{padded_tokens / real_tokens:.2f}x")
    if args.json:
        print(json.dumps({"seconds": seconds, "speedup": speed["packed"] / speed["padded"],
                          "ceiling": padded_tokens / real_tokens, "mean_len": real_tokens / len(lengths),
                          "max_len": max(lengths)}))


if __name__ == "__main__":
    main()
