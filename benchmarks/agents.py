"""The same tool task through the agents' endpoint (``rollout.agent``) and through the in-process multi-turn path
(``rollout.tools``), side by side in one run (docs/agents.md). Not a test.

    PYTHONPATH=. python benchmarks/agents.py [--seeds 3] [--steps 3] [--trajectories 64] [--shape tiny|small|smollm2]
        [--json out.json]

Both are the real CLI (``fsdptrain train``, one rank, ``OMP_NUM_THREADS=1``) on the tool-calling tiny model of
tests/e2e/test_multi_turn.py (it calls ``add`` from the first step), or that model at a larger shape (``--shape
small`` or ``smollm2``: a tiny model's decode is cheaper than any HTTP request, a real model's is not),
``--trajectories`` trajectories a step (``rollout.prompts_per_step`` x 4 samples), up to 3 turns and 160 tokens a
trajectory, the continuous engine. The in-process path runs ``add`` as a tool; the endpoint path runs the agent of
tests/e2e/test_agents.py, which calls the endpoint with the real ``openai`` client and answers ``add`` itself, all
trajectories' agents at once. Runs alternate seed by seed.

Reported per path: the policy's generated tokens per second of the step's ``generate`` phase
(``response_length/mean`` x ``batch/num_seqs`` / ``perf/generate_s``, the first step left out), the median generate
time, the endpoint's requests per trajectory, and the per-request overhead estimated as the endpoint's extra
generate time over its requests; then the ratio endpoint / in-process of the tokens per second.
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


SHAPES = {"tiny": None,
          "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                        num_key_value_heads=2),
          "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3)}
"""The policy's shape: the tool-calling tiny model of tests/e2e/test_multi_turn.py, or the same model 8 layers of
256 wide (``small``, about 7M weights), or at SmolLM2-135M's dimensions (its vocabulary the test tokenizer's), whose
decode costs what a real small model's does."""


def reshape_model(folder: Path, shape: dict) -> None:
    """The tool-calling model of ``folder`` rebuilt at ``shape``, with the same construction (a large constant first
    embedding dimension, the output head's first column favouring the two call tokens and EOS)."""
    import torch
    from transformers import AutoTokenizer

    from tests.helpers.tiny_llama import tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = tiny_llama(len(tokenizer), max_position_embeddings=1024, **shape)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[[2, len(tokenizer) - 2, len(tokenizer) - 1], 0] = 0.57
    model.save_pretrained(folder / "model")


def inputs(folder: Path, shape: str = "tiny") -> dict[str, list[str]]:
    """The model, prompts, tool, agent and reward under ``folder``; each path's overrides."""
    from tests.e2e.test_agents import TOOL_AGENT
    from tests.e2e.test_multi_turn import write_inputs

    write_inputs(folder)
    if SHAPES[shape] is not None:
        reshape_model(folder, SHAPES[shape])
    (folder / "agent.py").write_text(TOOL_AGENT)
    common = ["model=local", f"model.path={folder / 'model'}", "algorithm=grpo", "data=prompts",
              f"data.path={folder / 'prompts.jsonl'}", "data.num_eval_prompts=2", "rollout.max_new_tokens=160",
              "rollout.max_turns=3", "rollout.n=4", "trainer.eval_every=0", "rollout.max_live_rows=64"]
    return {"in-process": [*common, "rollout.tools=[tools.py:add]", "reward.functions=[rewards.py:ran_a_tool]"],
            "endpoint": [*common, f"rollout.agent={folder / 'agent.py'}:run"]}


def run(path: str, overrides: list[str], seed: int, *, steps: int, prompts: int, cwd: Path) -> list[dict]:
    name = f"{path}-{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fsdptrain.cli", "train", *overrides, f"rollout.prompts_per_step={prompts}",
           f"trainer.seed={seed}", f"trainer.steps={steps}", "logging.progress=false", f"trainer.run_name={name}",
           "checkpoint.every=0"]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def summarize(runs: list[list[dict]]) -> dict:
    rows = [row for r in runs for row in r[1:]]
    tokens = [row["response_length/mean"] * row["batch/num_seqs"] for row in rows]
    seconds = [row["perf/generate_s"] for row in rows]
    requests = [row["agents/requests/mean"] for row in rows if "agents/requests/mean" in row]
    return {"tokens_per_s": sum(tokens) / sum(seconds), "generate_s": statistics.median(seconds),
            "tokens": statistics.median(tokens), "requests_per_trajectory": statistics.fmean(requests) if requests
            else None, "trajectories": statistics.median(row["batch/num_seqs"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prompts = args.trajectories // 4
    with tempfile.TemporaryDirectory(prefix="fsdptrain-agents-") as tmp:
        folder = Path(tmp)
        paths = inputs(folder, args.shape)
        runs: dict[str, list] = {p: [] for p in paths}
        for seed in range(args.seeds):
            for path in (list(paths) if seed % 2 == 0 else list(reversed(paths))):
                runs[path].append(run(path, paths[path], seed, steps=args.steps, prompts=prompts, cwd=folder))
                print(f"seed {seed} {path}: done", file=sys.stderr, flush=True)
    summary = {p: summarize(r) for p, r in runs.items()}
    endpoint, inproc = summary["endpoint"], summary["in-process"]
    summary["ratio"] = endpoint["tokens_per_s"] / inproc["tokens_per_s"]
    requests = endpoint["requests_per_trajectory"] * endpoint["trajectories"]
    summary["overhead_ms_per_request"] = 1000 * (endpoint["generate_s"] - inproc["generate_s"]) / requests
    print(f"\n{args.shape} policy, {args.trajectories} trajectories a step, {args.seeds} seeds x {args.steps} steps (first left out)")
    print("| path | tokens/s (generate) | generate s (median) | tokens a step (median) | requests / trajectory |")
    print("| --- | --- | --- | --- | --- |")
    for path in paths:
        s = summary[path]
        per = "-" if s["requests_per_trajectory"] is None else f"{s['requests_per_trajectory']:.2f}"
        print(f"| {path} | {s['tokens_per_s']:.0f} | {s['generate_s']:.3f} | {s['tokens']:.0f} | {per} |")
    print(f"endpoint / in-process tokens/s: {summary['ratio']:.2f}; "
          f"overhead per request: {summary['overhead_ms_per_request']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
