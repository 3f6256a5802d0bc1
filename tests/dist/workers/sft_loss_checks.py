"""Worker: the SFT loss on FSDP2 ranks against transformers' own cross-entropy on one process (docs/sft.md).

The reference is :func:`tests.unit.test_sft.hand_loss` on the plain model (same config and seed) over the whole global
batch: labels -100 off the assistant's tokens, summed over the chats, divided by the global count of assistant
tokens. The ranks run the product path: the chats split over the ranks (evenly, or 3 and 1), each rank's share packed
into micro-batches by a given split or by the agreed plan, global normalisers (one all-reduce), the fused chunked
head, FSDP2's mean over ranks. Each rank writes, per case, the largest gradient difference (the gathered full gradients), the logged loss
(reduced over the ranks) and the reference loss to <out>/rank<r>.json.
"""

from __future__ import annotations

import warnings

import torch

from fsdptrain.data.demonstrations import DemoKeys, Demonstration, demonstration_ids
from fsdptrain.data.packing import PackPlan
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.distributed.fsdp import build_policy, gather_full_grads
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.loading import build_full_model
from fsdptrain.metrics.typed import finalize
from fsdptrain.train.pack_losses import packed_sft_loss, SftLossSettings
from fsdptrain.train.sft import as_minibatch
from fsdptrain.train.step import accumulate_gradients, global_normalizers
from tests.helpers.chatml_tokenizer import chatml_tokenizer
from tests.dist.workers.report import dist_worker
from tests.unit.test_sft import CHATS, hand_loss

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

SEED = 3
CHUNK = 7  # the fused head's chunks of 7 trained tokens end inside sequences
SHARES = {"even": [[0, 2], [1, 3]], "uneven": [[0, 1, 2], [3]]}
"""Which chats each rank holds."""
SPLITS = {"one": lambda n: [list(range(n))], "each": lambda n: [[i] for i in range(n)],
          "reversed": lambda n: [[i] for i in reversed(range(n))], "agreed": None}
"""How a rank packs its share into micro-batches (local indices). Given plans must have as many packs on every rank
(accumulate_gradients' contract), so "each" and "reversed" run on the even share only; "agreed" is the product's own
plan (`plan_agreed`) under a budget of the longest chat, where the rank with 3 chats needs more packs than the rank
with 1 and the agreement gives both the same count."""
CASES = [("even", "one"), ("even", "each"), ("even", "reversed"), ("uneven", "one"), ("uneven", "agreed")]


def config(vocab: int, tied: bool) -> dict:
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "tie_word_embeddings": tied}


def reference(demos, cfg: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_full_model("policy", path=None, config=cfg, seed=SEED)
    loss = hand_loss(model, demos)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run_case(demos, cfg: dict, share: str, split: str, info, mesh, ref) -> dict:
    mine = SHARES[share][info.rank]
    batch = as_minibatch([Demonstration(i, *demos[i]) for i in mine])
    model = build_policy(path=None, config=cfg, seed=SEED, mesh=mesh)
    set_attention(model, "sdpa_segments")
    lengths = batch.lengths()
    budget = max(len(p) + len(r) for p, r, _ in demos)  # the agreed plan's: rank 0's 3 chats need 2 packs
    if SPLITS[split] is None:
        plan = None
    else:
        parts = SPLITS[split](len(mine))
        plan = PackPlan(parts, [sum(lengths[i] for i in p) for p in parts], [1.0] * len(parts), 4096)
    norms = global_normalizers(batch, dp_size=world.dp_size(mesh), loss_scale_factor=None)
    done = accumulate_gradients(model, batch, loss_fn=packed_sft_loss, norms=norms, token_budget=budget,  # plan=None
                                device=info.device, plan=plan,
                                settings=SftLossSettings(agg_mode="token-mean", chunk_size=CHUNK))
    logged = finalize(reduce_metrics(done.metrics))
    grads = gather_full_grads(model)
    ref_loss, ref_grads = ref
    worst = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    return {"loss": logged["loss"], "reference_loss": ref_loss, "grad_max_diff": worst,
            "names_match": sorted(grads) == sorted(ref_grads), "global_tokens": norms.global_num_tokens,
            "micro_batches_all_ranks": logged["micro_batches"]}


@dist_worker(traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = {}
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    tokenizer = chatml_tokenizer()
    demos = [demonstration_ids({"messages": chat}, ["messages"], tokenizer=tokenizer, keys=DemoKeys())
             for chat in CHATS]
    for tied in (False, True):
        cfg = config(len(tokenizer), tied)
        ref = reference(demos, cfg)
        for share, split in CASES:
            name = f"{'tied' if tied else 'untied'}/{share}/{split}"
            out["results"][name] = run_case(demos, cfg, share, split, info, mesh, ref)


if __name__ == "__main__":
    main()
