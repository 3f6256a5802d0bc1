"""Per-rank peak memory of one packed forward + backward of a long row at cp=1 and cp=2 (docs/benchmarks.md,
docs/scaling.md). Not a test.

The medium model of benchmarks/fsdp_memory.py (qwen2, hidden 256, 4 layers, 8 heads, 4 kv heads), fp32, on the CPU
under gloo. One packed row of `--tokens` tokens holding two sequences (a quarter and three quarters of the row, so one
crosses the chunk boundaries), the policy loss (token-mean) through the trainer's path (`accumulate_gradients`).
cp=1 runs in one process; cp=2 runs on 2 ranks, one CP group (FSDP shards over both). The peak is the process's
resident set (ru_maxrss) minus the resident set just before the step: activations, the gathered keys and values
and the gradients, not the model's start-up.

Each layout runs twice. "live": glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`), so every tensor
above it is its own mapping and leaves the resident set when freed: the peak is that of the live tensors, the CPU's
analogue of `torch.cuda.max_memory_allocated`. "malloc default": glibc's dynamic threshold, which after a free
raises the threshold (up to 32 MiB) and keeps such blocks in its heap, so the peak also holds the heap's
fragmentation, which differs between the layouts.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/context_parallel.py --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--worker", action="store_true")
    return parser.parse_args(argv)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(args) -> None:
    from benchmarks.fsdp_memory import model_config
    from fsdptrain.distributed import world
    from fsdptrain.distributed.context_parallel import build_context_group
    from fsdptrain.distributed.fsdp import build_policy
    from fsdptrain.model.attention_switch import set_attention
    from fsdptrain.rl.fused_loss import SeqTargets
    from fsdptrain.rl.pg_terms import PolicyLossSettings
    from fsdptrain.train.pack_losses import packed_policy_loss
    from fsdptrain.train.step import MiniBatch, accumulate_gradients, global_normalizers

    torch.set_num_threads(1)
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu", cp=args.cp)
    context = build_context_group(args.cp)
    model = build_policy(path=None, config=model_config(hidden=args.hidden, layers=args.layers, vocab=args.vocab),
                         seed=0, mesh=mesh)
    set_attention(model, "sdpa_segments")
    gen = torch.Generator().manual_seed(0)
    quarter = args.tokens // 4
    prompts = [torch.randint(0, args.vocab, (64,), generator=gen).tolist() for _ in range(2)]
    responses = [torch.randint(0, args.vocab, (n - 64,), generator=gen).tolist() for n in (quarter, args.tokens - quarter)]
    targets = [SeqTargets(old_logprobs=None, advantages=torch.randn(len(r), generator=gen)) for r in responses]
    batch = MiniBatch(prompts, responses, targets)
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None,
                                  seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
                                  temperature=1.0, chunk_size=1024)
    norms = global_normalizers(batch, dp_size=world.dp_size(mesh), loss_scale_factor=None, context=context)
    world.barrier()
    before = _rss_bytes()
    start = time.perf_counter()
    accumulate_gradients(model, batch, loss_fn=packed_policy_loss, settings=settings, norms=norms,
                         token_budget=args.tokens, device=info.device, context=context)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    worst = world.all_reduce_max(torch.tensor([float(peak), seconds], dtype=torch.float64))
    if info.is_main:
        print(json.dumps({"cp": args.cp, "tokens": args.tokens, "peak_step_bytes": float(worst[0]),
                          "seconds": float(worst[1])}))
    world.destroy_distributed()
    world.exit_process(0)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return {}
    flags = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--layers", str(args.layers),
             "--vocab", str(args.vocab)]
    out = {}
    for measure, threshold in (("live", "65536"), ("malloc default", None)):
        one, two = _measure(flags, threshold)
        ratio = two["peak_step_bytes"] / one["peak_step_bytes"]
        print(f"one packed row of {args.tokens} tokens, forward + backward, per-rank peak above the start "
              f"({measure}): cp=1 {one['peak_step_bytes'] / 2**20:.0f} MiB ({one['seconds']:.1f} s), cp=2 "
              f"{two['peak_step_bytes'] / 2**20:.0f} MiB ({two['seconds']:.1f} s, largest rank): ratio {ratio:.3f}")
        out[measure] = {"one": one, "two": two, "ratio": ratio}
    return out


def _measure(flags: list[str], mmap_threshold: str | None) -> tuple[dict, dict]:
    """(cp=1, cp=2) results, the ranks launched with glibc's `MALLOC_MMAP_THRESHOLD_` set (None: glibc's default)."""
    from benchmarks.dist_util import launch

    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = mmap_threshold
    try:
        return launch(__file__, 1, [*flags, "--cp", "1"]), launch(__file__, 2, [*flags, "--cp", "2"])
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


if __name__ == "__main__":
    main()
