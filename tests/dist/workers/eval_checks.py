"""Worker: the sampled evaluation (trainer.eval_n > 1) on 2 gloo ranks against the same evaluation on one.

Each rank builds the same sharded tiny policy and the default task's PromptSource (8 evaluation prompts, 4 samples
each). It runs `PromptSource.eval_samples` twice on the same weights: split over the real ranks (prompt i on rank
i % 2) and reduced as the loop reduces it, and as a world of one (rank 0 of 1: every prompt, on every rank in
lockstep, so FSDP's collectives still pair up). It also records torch's global RNG state before and after. Every
rank writes <out>/rank<r>.json; tests/dist/test_eval.py asserts on them.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fsdptrain.config.compose import compose_config
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.distributed.fsdp import build_policy
from fsdptrain.model.loading import TINY_CONFIG
from fsdptrain.metrics.typed import finalize
from fsdptrain.rollout.prompt_source import PromptSource
from tests.dist.workers.report import dist_worker

OVERRIDES = ["trainer.eval_n=4", "trainer.eval_k=[1,2,4]", "trainer.eval_correct_threshold=0.3",
             "data.num_eval_prompts=8", "rollout.max_new_tokens=6"]


@dist_worker(traceback_in_record=True)
def main(args, info, out: dict) -> None:
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    tokenizer = load_bundled_tokenizer()
    config = {**TINY_CONFIG, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    model = build_policy(path=None, config=config, seed=3, mesh=mesh, param_dtype=torch.float32)
    source = PromptSource(compose_config(OVERRIDES), tokenizer)
    models = SimpleNamespace(policy=model, reward_models=[], reward_specs=[])
    cpu = torch.device("cpu")
    rng_before = torch.get_rng_state()
    split = source.eval_samples(models, step=5, rank=info.rank, world_size=info.world_size, device=cpu)
    out["two_ranks"] = finalize(reduce_metrics(split))
    out["one_rank"] = finalize(source.eval_samples(models, step=5, rank=0, world_size=1, device=cpu))
    out["rng_unchanged"] = bool(torch.equal(rng_before, torch.get_rng_state()))
    source.close()


if __name__ == "__main__":
    main()
