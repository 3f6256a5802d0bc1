"""``fsdptrain check-reward``: does the reward give the current model something to learn from? No training.

On every rank, build what sampling and scoring need as ``fsdptrain train`` builds it (data, reward functions, the
policy, the reward models; no critic, reference or optimizer), generate the first step's
``rollout.prompts_per_step`` prompts ``rollout.n`` times each with the current model, score them through the same
code as training, and report over all ranks, per function and for the weighted total: mean, population std, and the
share of prompt groups whose samples all scored the same (GRPO's group baseline learns nothing from those). Rank 0
also prints a few of its samples and the mean time of each function's calls during that scoring (no
extra call: every call ran under reward.timeout_s when one is set).

Exit 1 when every group's totals are all equal (nothing to learn), 0 otherwise (docs/your-task.md).
"""

from __future__ import annotations

import math
import random
import time

import torch
from omegaconf import DictConfig

from fsdptrain.config import ConfigError, validate_world
from fsdptrain.distributed import world
from fsdptrain.model.loading import build_tokenizer
from fsdptrain.rollout.prompt_source import PromptSource
from fsdptrain.rollout.rollout_source import build_source
from fsdptrain.run.console import log, print_samples
from fsdptrain.train.setup import build_sampling_models, resolve_device_type


def spread(values: list, groups: list[int]) -> list[float]:
    """Additive statistics ``[sum, sum of squares, count, all-equal groups, groups]`` of the values that are not
    None; a group counts when at least one of its values is a number."""
    numbers = [(g, float(v)) for g, v in zip(groups, values) if v is not None]
    by_group: dict[int, list[float]] = {}
    for g, v in numbers:
        by_group.setdefault(g, []).append(v)
    equal = sum(1 for vs in by_group.values() if min(vs) == max(vs))
    return [sum(v for _, v in numbers), sum(v * v for _, v in numbers), len(numbers), equal, len(by_group)]


def _line(name: str, stats: list[float]) -> str:
    total, squares, count, equal, num_groups = stats
    if count == 0:
        return f"  {name:<24} applied to no sample"
    mean = total / count
    std = math.sqrt(max(squares / count - mean * mean, 0.0))
    return (f"  {name:<24} mean {mean:.4f}  std {std:.4f}  all-equal groups {equal / num_groups:.2f} "
            f"({int(equal)}/{int(num_groups)})  samples {int(count)}")


def check_reward(cfg: DictConfig) -> int:
    """The ``fsdptrain check-reward`` job on this rank; returns the exit code (the same on every rank)."""
    if cfg.data.source == "jsonl":
        raise ConfigError("check-reward samples from the model: use data=task or data=prompts, not data=jsonl")
    info = world.init_distributed(device_type=resolve_device_type(cfg))
    replicate, shard = validate_world(cfg, info.world_size)
    mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type=info.device.type)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = build_tokenizer(cfg)
    source: PromptSource = build_source(cfg, tokenizer)
    try:
        models = build_sampling_models(cfg, tokenizer, mesh, info.device)
        start = time.perf_counter()
        rollouts = source.rollouts(models, 0, rank=info.rank, world_size=info.world_size, device=info.device)
        elapsed = time.perf_counter() - start
        batch, scores = source.last_batch, source.last_scores
        groups = [r.group for r in rollouts]
        names = [f.name for f in source.functions]
        local = [spread(scores.raw[name], groups) for name in names] + [spread(scores.total, groups)]
        stats = torch.tensor(local, dtype=torch.float64)
        merged = world.all_reduce_sum(stats.flatten()).reshape(stats.shape).tolist()
        # the calls the scoring made (bounded by reward.timeout_s in workers): no extra call without a deadline
        seconds = source.runner.call_seconds if source.runner is not None else {}
        timings = {name: seconds.get(name, []) for name in names}
    finally:
        source.close()
    log(f"check-reward: {len(rollouts) * info.world_size} samples ({cfg.rollout.prompts_per_step} prompts x "
        f"{cfg.rollout.n}) from the current model in {elapsed:.2f} s (generation and scoring)")
    log("reward spread (over all ranks):")
    for name, stats in zip(names + ["total (weighted)"], merged):
        log(_line(name, stats))
    log(f"time per call on rank 0 ({len(batch)} samples; mean over the calls that returned): "
        + ", ".join(f"{name} {sum(t) / len(t) * 1000:.1f} ms ({len(t)} calls)" if t else f"{name}: every call timed out"
                    for name, t in timings.items()))
    if info.is_main:
        print_samples(None, 0, source.samples)
    nothing = merged[-1][3] == merged[-1][4]
    if nothing:
        log("nothing to learn: every prompt group's samples got the same total reward, so group baselines give zero "
            "advantages. Check that the reward parses the completions (see the samples), or make the task easier")
    else:
        log("ok: some prompt groups have samples with different rewards")
    code = 1 if nothing else 0
    world.destroy_distributed()
    return code
