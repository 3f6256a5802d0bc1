"""Worker: generation with the policy's weights gathered once vs FSDP2's per-layer all-gather in every forward.

Each rank builds the same sharded tiny policy (tied and untied heads, fp32 and bf16 params) and generates the same
prompts greedily and with a seeded sampler, once per mode. It records the tokens, the number of FSDP all-gathers the
profiler saw, and whether the layer weights were plain (unsharded) tensors inside the block and DTensors after it.
The same again through the trainer's own rollout path (PromptSource.rollouts, the default task) with
rollout.gather_weights=always and =never, to check the setting reaches training's generation.
Every rank writes <out>/rank<r>.json; tests/dist/test_gather.py asserts on them.
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import DTensor

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.distributed import world
from tests.dist.workers.report import dist_worker
from fsdptrain.distributed.fsdp import build_policy
from fsdptrain.generation.gather import gathered_weights
from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.model.loading import TINY_CONFIG

PROMPTS = ["3 + 4 =", "repeat 7:", "hello", "9 9 9"]
VARIANTS = {"tied": (True, torch.float32), "untied_bf16": (False, torch.bfloat16)}


def generate(model, tokenizer, *, gather: bool, do_sample: bool) -> tuple[list[list[int]], int, bool]:
    """(token ids per prompt, all-gathers seen by the profiler, layer weights unsharded inside the block)."""
    from fsdptrain.generation.generate import generate_responses

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with generation_attention(model), gathered_weights(model, enabled=gather, reshard_after_forward=True):
            plain_inside = not isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)
            outputs = generate_responses(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                         do_sample=do_sample, generator_seed=1234, device=torch.device("cpu"))
    gathers = sum(1 for e in prof.events() if e.name.startswith("FSDP::all_gather") and "copy" not in e.name)
    return [p + r for p, r, _ in outputs], gathers, plain_inside


def trainer_rollouts(model, tokenizer, mode: str) -> tuple[list[list[int]], int]:
    """(token ids of this rank's rollouts of step 0, all-gathers seen) through the trainer's PromptSource."""
    from types import SimpleNamespace

    from fsdptrain.config.compose import compose_config
    from fsdptrain.rollout.prompt_source import PromptSource

    # rollout.engine=generate: the continuous engine always gathers for its block and never reads gather_weights
    cfg = compose_config([f"rollout.gather_weights={mode}", "rollout.prompts_per_step=4", "rollout.n=2",
                          "rollout.max_new_tokens=6", "rollout.engine=generate"])
    source = PromptSource(cfg, tokenizer)
    models = SimpleNamespace(policy=model, reward_models=[], reward_specs=[])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rollouts = source.rollouts(models, 0, rank=world.rank(), world_size=world.world_size(),
                                   device=torch.device("cpu"))
    source.close()
    gathers = sum(1 for e in prof.events() if e.name.startswith("FSDP::all_gather") and "copy" not in e.name)
    return [list(r.prompt_ids) + list(r.response_ids) for r in rollouts], gathers


@dist_worker(traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = {}
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    tokenizer = load_bundled_tokenizer()
    for name, (tied, dtype) in VARIANTS.items():
        config = {**TINY_CONFIG, "vocab_size": len(tokenizer), "tie_word_embeddings": tied,
                  "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        model = build_policy(path=None, config=config, seed=3, mesh=mesh, param_dtype=dtype)
        for sampling in ("greedy", "sampled"):
            for gather in (False, True):
                tokens, gathers, plain = generate(model, tokenizer, gather=gather, do_sample=sampling == "sampled")
                after = isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)
                out["results"][f"{name}/{sampling}/{'gathered' if gather else 'per_token'}"] = {
                    "tokens": tokens, "all_gathers": gathers, "unsharded_inside": plain, "sharded_after": after}
        if name == "tied":
            for mode in ("never", "always"):
                tokens, gathers = trainer_rollouts(model, tokenizer, mode)
                out["results"][f"trainer/{mode}"] = {"tokens": tokens, "all_gathers": gathers}


if __name__ == "__main__":
    main()
