"""Worker: sharded reward models against the plain transformers model in this process (each rank builds it).

Run under torchrun (any world size) or as a plain process. Rank r scores its own share of SEQUENCES in packs agreed
world-wide (`fsdptrain.distributed.collectives.plan_agreed`: a rank with less work runs an empty pack), with the reward model FSDP2-sharded
over every rank; the scores are all-gathered and compared with the plain model scoring each sequence alone. Also the
critic started from a reward model, and rank 0's architecture error reaching every rank. Writes <out>/rank<r>.json.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed

from fsdptrain.distributed import world as fdist
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.config import ConfigError
from fsdptrain.model.loading import TINY_CONFIG
from fsdptrain.model.reward_model import load_full_reward_model, load_reward_model_spec, score_sequences
from fsdptrain.distributed.fsdp_reward_models import build_reward_model, build_value_model_from_reward_model
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.distributed.collectives import plan_agreed
from tests.dist.workers.report import dist_worker, option

SEQUENCES = [[1, 7, 9, 11, 30], [1, 5, 6, 7, 8, 9, 10, 12, 40], [1, 22, 23], [1, 14, 15, 16, 17, 18, 19],
             [1, 8, 8, 9]]
SHARES = {1: [[0, 1, 2, 3, 4]], 2: [[0, 1, 2, 4], [3]]}
TOKEN_BUDGET = 12  # rank 0 needs 2 packs, rank 1 one: rank 1 runs an empty pack


def plain_scores(model) -> list[float]:
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in SEQUENCES]


def sharded_scores(spec, *, mesh, rank: int, world_size: int, offload: bool) -> dict:
    model = build_reward_model(spec, mesh=mesh, offload=offload)
    set_attention(model, "sdpa_segments")
    mine = SHARES[world_size][rank]
    ids = [SEQUENCES[i] for i in mine]
    plan = plan_agreed([len(x) for x in ids], TOKEN_BUDGET)
    local = score_sequences(model, ids, plan.packs, device="cpu")
    model.reshard()
    gathered: list = [None] * world_size
    torch.distributed.all_gather_object(gathered, dict(zip(mine, local.tolist())))
    by_index = {i: s for part in gathered for i, s in part.items()}
    return {"scores": [by_index[i] for i in range(len(SEQUENCES))], "num_packs": plan.num_packs,
            "frozen": not any(p.requires_grad for p in model.parameters()), "training": model.training}


def critic_last_values(spec, *, mesh) -> list[float]:
    critic = build_value_model_from_reward_model(spec, policy_tokenizer=load_bundled_tokenizer(), path=None,
                                                 config=TINY_CONFIG, mesh=mesh)
    with torch.no_grad():
        return [float(critic(input_ids=torch.tensor([ids])).logits[0, -1, 0]) for ids in SEQUENCES]


@dist_worker(option("--models", required=True, help="folder holding llama/, qwen2/ and policy_shaped/"))
def main(args, info, results: dict) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    mesh = fdist.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    results["world_size"] = info.world_size
    for arch in ("llama", "qwen2"):
        spec = load_reward_model_spec(Path(args.models, arch))
        results[arch] = {"plain": plain_scores(load_full_reward_model(spec))}
        for offload in (False, True):
            key = "offload" if offload else "sharded"
            results[arch][key] = sharded_scores(spec, mesh=mesh, rank=info.rank, world_size=info.world_size,
                                                offload=offload)
    spec = load_reward_model_spec(Path(args.models, "policy_shaped"))
    results["critic"] = {"plain": plain_scores(load_full_reward_model(spec)),
                         "values": critic_last_values(spec, mesh=mesh)}
    try:
        critic_last_values(load_reward_model_spec(Path(args.models, "qwen2_bundled")), mesh=mesh)
        results["mismatch_error"] = None
    except ConfigError as err:
        results["mismatch_error"] = str(err)


if __name__ == "__main__":
    main()
