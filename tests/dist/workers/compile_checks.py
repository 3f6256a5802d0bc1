"""Worker: ``parallel.compile`` leaves the training step's numbers unchanged and generation eager.

Two policies are built the product's way (``build_models`` from a composed config, same seed), one with
``parallel.compile=true parallel.compile_backend=<backend>`` and one without. Both run the packed training
forward + backward (``accumulate_gradients`` with the fused policy loss) on two mini-batches of different lengths
(so the dynamic-shape graph is reused, not recompiled per length), and greedy generation through the product's
``generation`` block. Each rank writes to <out>/rank<r>.json: the losses, the worst gradient difference relative to
the largest eager entry, dynamo's graph and graph-break counts during training and during generation, and whether
the generated tokens are the same.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch._dynamo.utils import counters

from fsdptrain.config.compose import compose_config
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import gather_full_grads
from fsdptrain.generation.generate import generate_responses
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.train.pack_losses import packed_policy_loss
from fsdptrain.generation.block import generation
from fsdptrain.train.setup import build_models, policy_settings
from fsdptrain.model.loading import build_tokenizer
from fsdptrain.train.step import MiniBatch, accumulate_gradients
from tests.dist.workers.report import dist_worker, option

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

TOKEN_BUDGET = 40  # two or more packs per mini-batch


def mini_batch(seed: int, num_seqs: int, vocab: int) -> MiniBatch:
    gen = torch.Generator().manual_seed(seed)
    batch = MiniBatch([], [], [])
    for _ in range(num_seqs):
        p, r = int(torch.randint(3, 9, (), generator=gen)), int(torch.randint(1, 9, (), generator=gen))
        batch.prompts.append(torch.randint(4, vocab, (p,), generator=gen).tolist())
        batch.responses.append(torch.randint(4, vocab, (r,), generator=gen).tolist())
        batch.targets.append(SeqTargets(old_logprobs=-4.0 + 0.5 * torch.randn(r, generator=gen),
                                        advantages=torch.randn(r, generator=gen),
                                        ref_logprobs=-4.0 + 0.5 * torch.randn(r, generator=gen)))
    return batch


def graph_counts() -> dict[str, int]:
    return {"graphs": int(counters["stats"]["unique_graphs"]), "breaks": int(sum(counters["graph_break"].values()))}


def train_and_generate(overrides: list[str], info, mesh, tokenizer) -> dict:
    """Losses and full gradients of two mini-batches' packed forward + backward, then greedy tokens."""
    cfg = compose_config(["algorithm.use_kl_loss=true", *overrides])
    models = build_models(cfg, tokenizer, mesh, info.device, num_steps=1)
    vocab = len(tokenizer)
    losses, grads, seconds, per_batch = [], [], [], []
    for seed, num_seqs in ((0, 9), (1, 13)):
        batch = mini_batch(seed, num_seqs, vocab)
        total = world.all_reduce_sum(torch.tensor([sum(len(r) for r in batch.responses), num_seqs],
                                                  dtype=torch.float64))
        norms = LossNormalizers(global_num_tokens=int(total[0]), global_num_seqs=int(total[1]),
                                dp_size=world.dp_size(mesh), loss_scale_factor=None)
        start = time.perf_counter()
        done = accumulate_gradients(models.policy, batch, loss_fn=packed_policy_loss, settings=policy_settings(cfg),
                                    norms=norms, token_budget=TOKEN_BUDGET, device=info.device)
        seconds.append(time.perf_counter() - start)
        losses.append(done.loss)
        grads.append(gather_full_grads(models.policy))
        per_batch.append(graph_counts())
        models.policy.zero_grad(set_to_none=True)
    trained = graph_counts()
    prompts = [batch.prompts[i] for i in range(4)]
    with generation(models.policy, cfg, info.device):
        tokens = generate_responses(models.policy, tokenizer, prompts, max_new_tokens=5, temperature=1.0, top_p=1.0,
                                    do_sample=False, generator_seed=0, device=info.device)
    return {"losses": losses, "grads": grads, "seconds": seconds, "tokens": [t[1] for t in tokens],
            "after_training": trained, "per_batch": per_batch, "after_generation": graph_counts(),
            "break_reasons": sorted(counters["graph_break"])}


def worst_relative(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    scale = max(v.abs().max().item() for v in want.values())
    return max((got[n] - want[n]).abs().max().item() for n in want) / scale


@dist_worker(option("--backend", default="aot_eager"), traceback_in_record=True)
def main(args, info, out: dict) -> None:
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    tokenizer = build_tokenizer(compose_config([]))
    eager = train_and_generate([], info, mesh, tokenizer)
    counters.clear()
    compiled = train_and_generate(["parallel.compile=true", f"parallel.compile_backend={args.backend}"], info,
                                  mesh, tokenizer)
    out.update({
        "eager_losses": eager["losses"], "compiled_losses": compiled["losses"],
        "grad_rel": [worst_relative(c, e) for c, e in zip(compiled["grads"], eager["grads"])],
        "eager_graphs": eager["after_generation"], "after_training": compiled["after_training"], "per_batch": compiled["per_batch"],
        "after_generation": compiled["after_generation"], "break_reasons": compiled["break_reasons"],
        "same_tokens": compiled["tokens"] == eager["tokens"], "num_tokens": sum(map(len, eager["tokens"])),
        "eager_seconds": eager["seconds"], "compiled_seconds": compiled["seconds"],
    })


if __name__ == "__main__":
    main()
