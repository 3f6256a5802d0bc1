"""What a run prints: rank-0 lines, the start report, the first step's samples, the progress bar, the summary."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Optional, Sequence

from fsdptrain.distributed import world
from fsdptrain.model.loading import describe_model_memory
from fsdptrain.rl.grad_scale import grad_scale_report


def log(message: str) -> None:
    """Print on rank 0 only."""
    if world.rank() == 0:
        print(message, flush=True)


def print_start_report(cfg, *, world_size: int, device, mesh_shape: tuple, backend: str, share_prompts: str, policy,
                       dp_size: int, loss_scale_factor: float, max_len: int, source_line: Optional[str]) -> None:
    """Model sizes, the backend, the source's line, and the gradient scale of the configured mode with its
    normalisation in words."""
    experts = (f", experts over ep={cfg.parallel.ep} (mesh (dp_shard_mod_ep, ep) = ({world_size // cfg.parallel.ep}, "
               f"{cfg.parallel.ep}))" if cfg.parallel.ep > 1 else "")
    log(f"fsdptrain: {world_size} rank(s) on {device.type}, mesh {mesh_shape}{experts}, packed attention: {backend}, "
        f"shared prompts: {share_prompts}")
    if source_line is not None:
        log(source_line)
    log("policy: " + describe_model_memory(policy, num_shards=dp_size))
    seqs = cfg.rollout.prompts_per_step // cfg.trainer.mini_batches_per_step * (
        cfg.rollout.n if cfg.data.source != "jsonl" else 1)
    if cfg.loss.loss_scale_factor is None and cfg.loss.agg_mode == "seq-mean-token-sum-norm":
        log(f"loss.loss_scale_factor is null: using the configured maximum response length {max_len}")
    report = grad_scale_report(cfg.loss.agg_mode, num_tokens=seqs * max_len, num_seqs=seqs,
                               seq_lengths=[max_len] * seqs, dp_size=dp_size,
                               loss_scale_factor=loss_scale_factor, grad_clip=cfg.trainer.grad_clip)
    log(f"normalisation (a mini-batch of {seqs} sequences at the maximum length {max_len}): " + report.describe())


def print_samples(console, step: int, samples: list[dict]) -> None:
    """Show a few samples of the first step, so the user sees at once whether the reward parses the completions."""
    lines = [f"samples at step {step} (prompt -> completion: rewards per function, total):"]
    for s in samples:
        rewards = ", ".join(f"{name} {'-' if v is None else f'{v:.3g}'}" for name, v in s["rewards"].items())
        if "turns" not in s:
            lines.append(f"  {s['prompt'][-60:]!r} -> {s['completion'][:60]!r}: {rewards}; total {s['total']:.3g}")
            continue
        truncated = f" (truncated: {s['truncated']})" if s["truncated"] else ""
        lines.append(f"  {s['prompt'][-60:]!r} -> {len(s['turns'])} messages{truncated}: {rewards}; "
                     f"total {s['total']:.3g}")
        lines += [f"    {line}" for line in conversation_lines(s["turns"])]
    if console is not None:  # above a live progress bar
        for line in lines:
            console.print(line, markup=False, highlight=False)
    else:
        log("\n".join(lines))


def conversation_lines(messages: list[dict]) -> list[str]:
    """One line per message of a multi-turn sample: each assistant turn with its tool calls' names and arguments,
    each tool result (a result not appended, for lack of budget, is marked so)."""
    lines = []
    for m in messages:
        if m["role"] == "assistant":
            calls = "; ".join(f"{c['function']['name']}({json.dumps(c['function']['arguments'])})"
                              for c in m.get("tool_calls", []))
            lines.append(f"assistant: {m['content'][:60]!r}" + (f" calls {calls}" if calls else ""))
        else:
            dropped = " (not appended: over rollout.max_new_tokens)" if m.get("appended") is False else ""
            lines.append(f"{m['role']} {m.get('name', '')}: {m['content'][:60]!r}{dropped}")
    return lines


def progress_columns():
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    return (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn())


def stats_line(result: dict, fields: Sequence[tuple[str, str, str]]) -> str:
    """The progress bar's text of a step: ``label value`` for each ``(metric, label, format spec)`` of ``fields``
    that the step's ``result`` holds (a recipe's ``stats``)."""
    return "  ".join(f"{label} {result[key]:{spec}}" for key, label, spec in fields if key in result)


def print_summary(history: list[dict], eval_rewards: dict[int, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fsdptrain summary")
    table.add_column("what")
    table.add_column("value", justify="right")
    first = history[: min(5, len(history))]
    last = history[-min(5, len(history)):]
    table.add_row("steps", str(len(history)))
    table.add_row("initial policy's mean reward (first step, sampled)", f"{history[0]['reward/mean']:.3f}")
    table.add_row("mean reward, first 5 steps", f"{sum(r['reward/mean'] for r in first) / len(first):.3f}")
    table.add_row("mean reward, last 5 steps", f"{sum(r['reward/mean'] for r in last) / len(last):.3f}")
    if eval_rewards:
        steps = sorted(eval_rewards)
        table.add_row(f"eval reward (greedy) at step {steps[0]}", f"{eval_rewards[steps[0]]:.3f}")
        table.add_row(f"eval reward (greedy) at step {steps[-1]}", f"{eval_rewards[steps[-1]]:.3f}")
    for row in perf_summary_rows(history):
        table.add_row(*row)
    Console(file=sys.stdout).print(table)


def perf_summary_rows(history: list[dict]) -> list[tuple[str, str]]:
    """Mean seconds per step of each phase (share of the step), throughput and peak memory (docs/performance.md)."""
    mean = {key: sum(r[key] for r in history) / len(history) for key in history[0]
            if key.startswith("perf/") and all(key in r for r in history)}
    step = mean["perf/step_s"]
    rows = [("mean step time", f"{step:.3f} s")]
    for name in ("generate", "reward", "experience", "update", "other"):
        seconds = mean[f"perf/{name}_s"]
        rows.append((f"  {name}", f"{seconds:.3f} s ({100 * seconds / step:.0f}%)"))
    for key, label, fmt in (("perf/generated_tokens_per_s", "generated tokens/s", "{:.0f}"),
                            ("perf/trained_tokens_per_s", "trained tokens/s", "{:.0f}"),
                            ("perf/tflops_per_rank", "TFLOP/s per rank", "{:.4f}"), ("perf/mfu", "MFU", "{:.1%}")):
        if key in mean:
            rows.append((label, fmt.format(mean[key])))
    rows.append(("peak memory per rank", f"{max(r['perf/peak_mem_gib'] for r in history):.2f} GiB"))
    return rows


def quiet_known_warnings() -> None:
    """FSDP2 warns once that the root returned a view of its output (we take ``logits[0, :, 0]`` and the hidden
    states); we never modify those views in place, which is the case the warning is about."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
