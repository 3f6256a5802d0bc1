"""The generation gap of a mixture-of-experts policy with and without routing replay (docs/moe.md, "Routing
replay"). Not a test.

    PYTHONPATH=. python benchmarks/routing_replay.py [--spreads 1e-6 3e-7 1e-7] [--engines continuous generate]

For each router spread (tests/helpers/tiny_moe.py: the tiny Qwen3-MoE, 2 MoE layers, 4 experts, top-2, whose router
rows are one shared row plus that relative noise: smaller is nearer a tie) and each rollout engine, the real CLI runs
one GRPO step (4 prompts x 2 samples, 16 new tokens, one rank, float32 on the CPU) without and with
``model.moe.routing_replay=true`` and the old log-prob pass forced (``algorithm.recompute_old_logprobs=always``), and
reports its first step's ``moe/topk_differ/tokens`` (the training routers' own top-k against the generation's, before
replay) and ``rollout/logprob_diff/max`` and ``/mean`` (the training forward's log-prob of each sampled token against
the generating forward's, on the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN = ("algorithm=grpo", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=16",
       "trainer.eval_every=0", "logging.progress=false", "trainer.steps=1", "algorithm.recompute_old_logprobs=always")


def first_row(folder: Path, run_dir: Path, *overrides: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "fsdptrain.cli", "train", f"model.path={folder}", *RUN, *overrides,
                           f"trainer.run_dir={run_dir}"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout + proc.stderr)
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def main() -> None:
    from tests.helpers.tiny_moe import save_tiny_moe

    parser = argparse.ArgumentParser()
    parser.add_argument("--spreads", type=float, nargs="+", default=[1e-6, 3e-7, 1e-7])
    parser.add_argument("--engines", nargs="+", default=["continuous", "generate"])
    args = parser.parse_args()
    print("| router spread | engine | replay | top-k differs (tokens) | logprob_diff max | logprob_diff mean |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for spread in args.spreads:
            folder = save_tiny_moe(Path(tmp) / f"model_{spread:g}", router_spread=spread)
            for engine in args.engines:
                for replay in ("false", "true"):
                    row = first_row(folder, Path(tmp) / f"run_{spread:g}_{engine}_{replay}",
                                    f"rollout.engine={engine}", f"model.moe.routing_replay={replay}")
                    print(f"| {spread:g} | {engine} | {replay} | {row['moe/topk_differ/tokens']:.3f} | "
                          f"{row['rollout/logprob_diff/max']:.2e} | {row['rollout/logprob_diff/mean']:.2e} |",
                          flush=True)


if __name__ == "__main__":
    main()
