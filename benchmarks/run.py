"""Every benchmark, one after another, and one table of ratios measured side by side (docs/performance.md).

    PYTHONPATH=. python benchmarks/run.py [--json out.json] [--threads 1] [--repeats 2] [--steps 8]

Each row spawns its own process(es) (torchrun for the multi-rank rows, the real ``fsdptrain train`` CLI for the
step-time rows), pinned to ``--threads`` torch threads each (1 by default: steadiest on a shared 2-core machine).
The ratio rows that time work inside one process (the train step, the loss rows) compare the process's CPU time,
the work done whatever else the shared machine runs; their details give the wall-time ratio too. The step-time rows
of the CLI runs are wall time (`perf/step_s`). Rows with no goal are reported, not judged. GPU rows (flash_attn vs sdpa_segments, MFU of a 0.5B-class model) need a
GPU and are listed as unchecked where there is none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import fsdp_memory, generate  # noqa: E402
from benchmarks import lora as lora_bench  # noqa: E402
from benchmarks import loss as loss_bench  # noqa: E402
from benchmarks.dist_util import REPO_ROOT  # noqa: E402

MEDIUM = ("model.hidden_size=256", "model.num_layers=4", "model.intermediate_size=1024", "model.num_heads=8",
          "model.num_kv_heads=4", "rollout.max_new_tokens=16")
RUN = ("trainer.eval_every=0", "logging.progress=false")


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def train_run(*overrides: str, threads: int) -> list[dict]:
    """``fsdptrain train`` with the overrides in a temporary run directory; its metrics.jsonl lines."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fsdptrain.cli", "train", *RUN, *overrides, f"trainer.run_dir={tmp}/run"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads), cwd=REPO_ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines() if line]


def median_after_first(lines: list[dict], key: str) -> float:
    return statistics.median(line[key] for line in lines[1:])


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the finished child processes: the table's work, whatever the machine's load."""
    times = os.times()
    return times.children_user + times.children_system


def row(name: str, value: float, goal: str | None, detail: str) -> dict:
    verdict = "-"
    if goal is not None:
        op, bound = goal.split()
        verdict = "PASS" if (value >= float(bound) if op == ">=" else value <= float(bound)) else "FAIL"
    return {"row": name, "value": value, "goal": goal or "report", "verdict": verdict, "detail": detail}


def train_step_row(args) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "train_step.py"), "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(args.threads), cwd=REPO_ROOT, check=True)
    res = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = res["seconds"]["cpu"]
    return row("PPO step (exp.+update, policy+value) packed vs padded TRL-style, CPU time", res["speedup"]["cpu"],
               ">= 3.0", f"padding ceiling {res['ceiling']:.2f}x (mean len {res['mean_len']:.0f}, max "
               f"{res['max_len']}); CPU s/step {cpu['padded']:.1f} -> {cpu['packed']:.1f}; wall ratio "
               f"{res['speedup']['wall']:.2f}")


def loss_rows(args) -> list[dict]:
    # The memory rows: the first forward+backward gives the peak and, with two more, the time (best of 3); the
    # forward-only timing of loss.py is not a row and is skipped.
    largs = loss_bench._parse_args(["--repeats", "2", "--threads", str(args.threads)])
    # The packed rows on a smaller head than loss.py's default (V 32000, H 512), which alone takes minutes per row on
    # a shared 2-core machine; the memory rows keep the T 8192, V 32000, H 512.
    # 8 sequences take about 0.4 s a pass: best of 5 (one sample was within the machine's noise of 1.0); 64: one.
    rows = []
    for num_seqs, repeats in ((8, 5), (64, 1)):
        packed_args = loss_bench._parse_args(["--repeats", str(repeats), "--vocab", "8192", "--hidden", "256",
                                              "--threads", str(args.threads)])
        res = loss_bench._run_worker(packed_args, "packed", num_seqs=num_seqs)
        cpu, wall = res["cpu_times_s"], res["times_s"]
        rows.append(row(f"fused packed loss vs per-sequence loop, {num_seqs} seqs, V 8k H 256 (speed-up)",
                        cpu["per-sequence loop"] / cpu["fused packed"], ">= 1.0",
                        f"fused {cpu['fused packed']:.3f} s CPU; wall ratio "
                        f"{wall['per-sequence loop'] / wall['fused packed']:.2f}"))
    res = {m: loss_bench._run_worker(largs, "memory", method=m, skip_forward=True) for m in ("naive", "chunked")}
    rows.append(row("chunked log-prob extra peak memory / naive (T 8192, V 32000, H 512)",
                    res["chunked"]["extra_mib"] / res["naive"]["extra_mib"], "<= 0.05",
                    f"naive {res['naive']['extra_mib']:.0f} MiB"))
    naive, chunked = res["naive"], res["chunked"]
    rows.append(row(f"chunked log-prob fwd+bwd CPU time / naive (chunk {largs.chunk_size})",
                    chunked["fwd_bwd_cpu_s"] / naive["fwd_bwd_cpu_s"], "<= 1.0",
                    f"naive {naive['fwd_bwd_cpu_s']:.2f} s CPU; wall ratio "
                    f"{chunked['fwd_bwd_s'] / naive['fwd_bwd_s']:.2f}"))
    return rows


def dist_rows(args) -> list[dict]:
    mem = fsdp_memory.main(["--nproc", "2"])
    gen = generate.main(["--nproc", "2", "--repeats", "1", "--new-tokens", "16"])
    return [row("FSDP2 per-rank params+grads+AdamW, 2 ranks / 1", mem["ratio"], "<= 0.55",
                f"1 rank {mem['one']['max_rank_bytes'] / 2**20:.1f} MiB"),

            row("generation tok/s, gathered once / per-token gathers (2 ranks)", gen["ratio"], ">= 1.0",
                f"{gen['per_token']:.0f} -> {gen['gathered']:.0f} tok/s, same tokens {gen['same_tokens']}")]


def lora_memory_rows(args) -> list[dict]:
    """LoRA r=16 against full fine-tuning, per rank at 2 ranks, on the medium model's shape (bf16 params: the frozen
    base weights and full fine-tuning's KL reference are stored in the param dtype, docs/lora.md), without and with a
    KL term; then the same ratios computed from the parameter counts of 7B/8B shapes (benchmarks/lora.py memory)."""
    shape = ["--nproc", "2", "--hidden", "256", "--layers", "4", "--param-dtype", "bfloat16"]
    rows = []
    for kl in ([], ["--kl-reference"]):
        full = fsdp_memory.main([*shape, *kl])["many"]
        lora = fsdp_memory.main([*shape, *kl, "--lora-r", "16"])["many"]
        rows.append(row(f"LoRA r=16 per-rank params+grads+AdamW{' + KL reference' if kl else ''} / full fine-tuning "
                        "(medium, bf16, 2 ranks)", lora["max_rank_bytes"] / full["max_rank_bytes"],
                        None if kl else "<= 0.15",
                        f"full {full['max_rank_bytes'] / 2**20:.1f} MiB (reference {full['reference'] / 2**20:.1f}) "
                        f"-> LoRA {lora['max_rank_bytes'] / 2**20:.1f} MiB (params {lora['params'] / 2**20:.1f}, "
                        f"grads {lora['grads'] / 2**20:.2f}, AdamW {lora['state'] / 2**20:.2f} MiB on rank 0)"))
    for name, got in lora_bench.main(["memory"]).items():
        if name.startswith("medium"):
            continue  # measured above
        rows.append(row(f"LoRA r=16 params+grads+AdamW / full fine-tuning, {name}, bf16, computed", got["ratio"],
                        None, f"with a KL reference {got['ratio_kl']:.3f}; {got['adapters'] / 1e6:.1f} M adapter "
                        f"parameters on {got['base'] / 1e9:.2f} B"))
    return rows


def lora_generate_row(args) -> dict:
    res = lora_bench.main(["generate", "--threads", str(args.threads)])
    return row("LoRA r=16 generation: adapters separate / merged (+ merge, unmerge), CPU time",
               res["speedup_with_merge"], None,
               f"separate {res['separate_s']:.3f} s, merged {res['merged_s']:.3f} s + {res['merge_unmerge_s']:.3f} s "
               f"to merge and unmerge; same tokens {res['same_tokens']} (the trainer keeps them separate)")


def lora_rows(args) -> list[dict]:
    """LoRA r=16 against full fine-tuning on the medium model's shape (docs/lora.md)."""
    update = lora_bench.main(["update", "--threads", str(args.threads)])
    return [*lora_memory_rows(args), lora_generate_row(args),
            row("LoRA r=16 update CPU time / full fine-tuning (medium, plain model)", update["ratio"], None,
                f"full {update['full_s']:.3f} s -> LoRA {update['lora_s']:.3f} s per update of 16 x 64 tokens")]


def step_rows(args) -> list[dict]:
    steps = f"trainer.steps={args.steps}"
    # The skip is exact, so both runs do the same steps on the same rollouts but for the skipped pass: compare them
    # step by step (the median of the per-step ratios), which cancels the drift of a shared machine between the two
    # runs better than a ratio of two runs' medians does. On the medium model: on the default's 0.1 s steps the
    # saved pass (about 8 ms) is smaller than the run-to-run drift.
    always = train_run(steps, *MEDIUM, "algorithm.recompute_old_logprobs=always", threads=args.threads)
    auto = train_run(steps, *MEDIUM, threads=args.threads)
    saving = statistics.median(a["perf/step_s"] / b["perf/step_s"] for a, b in zip(always[1:], auto[1:], strict=True))
    rows = [row("on-policy pass skipped: step time recompute / skip (medium model)", saving,
                ">= 1.0", f"experience {median_after_first(always, 'perf/experience_s'):.3f} -> "
                f"{median_after_first(auto, 'perf/experience_s'):.3f} s; step {median_after_first(always, 'perf/step_s'):.3f}"
                f" -> {median_after_first(auto, 'perf/step_s'):.3f} s")]
    lora = train_run(steps, *MEDIUM, "model.lora.r=16", "trainer.lr=1e-3", threads=args.threads)
    lora_ratio = statistics.median(a["perf/step_s"] / b["perf/step_s"] for a, b in zip(lora[1:], auto[1:], strict=True))
    rows.append(row("LoRA r=16 step time / full fine-tuning (medium model)", lora_ratio, None,
                    f"update {median_after_first(auto, 'perf/update_s'):.3f} -> "
                    f"{median_after_first(lora, 'perf/update_s'):.3f} s; generate "
                    f"{median_after_first(auto, 'perf/generate_s'):.3f} -> "
                    f"{median_after_first(lora, 'perf/generate_s'):.3f} s"))
    fp32 = auto  # the same run: the medium model in fp32 with the default (skipping) recompute setting
    bf16 = train_run(steps, *MEDIUM, "parallel.param_dtype=bfloat16", threads=args.threads)
    ratio = median_after_first(fp32, "perf/step_s") / median_after_first(bf16, "perf/step_s")
    rows.append(row("bf16 vs fp32 step time (medium: 4 x 256, 16 new tokens), speed-up", ratio, None,
                    f"fp32 {median_after_first(fp32, 'perf/step_s'):.2f} s/step"))
    default = train_run(steps, threads=args.threads)
    phases = {k: median_after_first(default, f"perf/{k}_s") for k in ("generate", "reward", "experience", "update",
                                                                     "other")}
    total = median_after_first(default, "perf/step_s")
    detail = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in phases.items())
    rows.append(row("default run: step time (s), phase shares", total, None, detail))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="steps of each fsdptrain train run (the first is warm-up)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = []
    for section in (train_step_row, loss_rows, dist_rows, lora_rows, step_rows):
        began, began_cpu = time.perf_counter(), _children_cpu_s()
        got = section(args)
        rows += got if isinstance(got, list) else [got]
        print(f"{section.__name__}: {time.perf_counter() - began:.0f} s wall, {_children_cpu_s() - began_cpu:.0f} s "
              f"CPU in its processes, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows.append(row("flash_attn vs sdpa_segments (GPU)", float("nan"), None, "unchecked: no GPU"))
    rows.append(row("MFU, 0.5B-class config (GPU)", float("nan"), None, "unchecked: no GPU"))
    elapsed = time.perf_counter() - start
    print(f"\nbenchmarks/run.py: {elapsed:.0f} s ({_children_cpu_s():.0f} s CPU in its processes), torch {torch.__version__}, {args.threads} thread(s) per process, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"| {'row':<72} | {'value':>7} | {'goal':<7} | verdict | detail")
    for r in rows:
        print(f"| {r['row']:<72} | {r['value']:7.3f} | {r['goal']:<7} | {r['verdict']:<7} | {r['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": elapsed, "cpu_seconds": _children_cpu_s(), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
