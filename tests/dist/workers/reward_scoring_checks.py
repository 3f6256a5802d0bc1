"""Worker: the experience path's reward-model scoring (rollout/scoring.py) over this world's ranks.

Two reward models (a Llama with a chat template, a Qwen2 without one) score SAMPLES over two steps with running
normalisation, a clip and weights; rank r holds SHARES[world_size][r] (uneven: rank 1 of 2 holds 2 of 6). Writes
<out>/rank<r>.json: the per-sample totals and raw scores by global index (all-gathered), the running moments after
each step and the step's metrics reduced over ranks and finalised. Run under torchrun or as a plain process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed

from fsdptrain.distributed import world as fdist
from fsdptrain.distributed.fsdp_reward_models import build_reward_model
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.reward_model import load_reward_model_spec
from fsdptrain.metrics.typed import finalize
from fsdptrain.rl.reward_scale import RunningMoments
from fsdptrain.rollout.scoring import score_with_reward_models
from fsdptrain.distributed.collectives import reduce_metrics
from tests.dist.workers.report import dist_worker, option

STEPS = [
    [("repeat 3 =", " 3 3"), ("copy 12 =", " 1 2"), ("sort 31 =", " 1 3 7"), ("reverse 45 =", ""),
     ("repeat 7 =", " 7 7 7 7"), ("copy 9 =", " 8")],
    [("sort 77 =", " 7"), ("repeat 1 =", " 1"), ("copy 56 =", " 5 6 ,"), ("reverse 12 =", " 2 1"),
     ("repeat 0 =", " 0 0"), ("sort 90 =", " 0 9 -")],
]
SHARES = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 1, 2, 3], [4, 5]]}
TOKEN_BUDGET = 24  # rank 0 needs more packs than rank 1, which runs empty ones


def gather(mine: list[int], values: list) -> list:
    parts: list = [None] * fdist.world_size()
    if fdist.world_size() > 1:
        torch.distributed.all_gather_object(parts, dict(zip(mine, values)))
    else:
        parts = [dict(zip(mine, values))]
    by_index = {i: v for part in parts for i, v in part.items()}
    return [by_index[i] for i in range(len(by_index))]


@dist_worker(option("--models", required=True, help="folder holding chat/ and qwen2/"))
def main(args, info, results: dict) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    mesh = fdist.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    specs = [load_reward_model_spec(Path(args.models, name)) for name in ("chat", "qwen2")]
    models = [build_reward_model(spec, mesh=mesh) for spec in specs]
    for model in models:
        set_attention(model, "sdpa_segments")
    mine = SHARES[info.world_size][info.rank]
    running = [RunningMoments(), RunningMoments()]
    results["steps"] = []
    for samples in STEPS:
        prompts, completions = [samples[i][0] for i in mine], [samples[i][1] for i in mine]
        out = score_with_reward_models(models, specs, prompts, completions, weights=[1.0, 0.5], mode="running",
                                       clip=1.5, running=running, token_budget=TOKEN_BUDGET,
                                       device=torch.device("cpu"))
        running = out.running
        results["steps"].append({
            "total": gather(mine, out.total_N.tolist()),
            "raw": [gather(mine, raw.tolist()) for raw in out.raw_N],
            "running": [m.state_dict() for m in running],
            "metrics": finalize(reduce_metrics(out.metrics)),
        })


if __name__ == "__main__":
    main()
