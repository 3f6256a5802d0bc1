"""LoRA r=16 against full fine-tuning on the medium benchmark model, one process each (docs/lora.md). Not a test.

    PYTHONPATH=. python benchmarks/lora.py generate|update|memory [--hidden 256 --layers 4 --r 16]

generate: with ``rollout.gather_weights`` the trainer generates from the gathered weights with the adapters separate
(each adapted linear adds two thin matmuls, x A^T B^T, per token). Merging W + (alpha / r) B A before generating (and
unmerging after) saves those matmuls but costs a pass over every adapted weight twice per step and changes the
rounding of the sampled model. This times both on the same unsharded model: CPU seconds of ``generate``, best of
``--repeats``, plus one merge + unmerge.

update: the trainer's `update_on_minibatch` on the plain (not sharded) model: packed forward, fused PPO-clip loss,
backward, clip, AdamW step. LoRA adds two thin matmuls per adapted linear in forward and backward but drops the base
weights' gradients (the backward still runs through them for the activations) and their AdamW update. One warm-up
update each, then --repeats timed ones, interleaved; the best process CPU time of each.

memory: per-rank parameter + gradient + AdamW bytes of LoRA over full fine-tuning with bf16 params, computed from the
parameter counts of benchmarks/fsdp_memory.py's medium model and of 7B/8B shapes (built on the meta device, nothing
allocated): full fine-tuning keeps 16 bytes per parameter (fp32 master weight, gradient, two AdamW moments) and,
with a KL term, a frozen reference copy at 2 bytes per parameter; LoRA keeps 2 bytes per frozen base weight and 16
per adapter parameter, and no reference copy. Sharding divides both sides by the same rank count.
benchmarks/fsdp_memory.py measures the medium model's shards; this gives the shapes it cannot allocate.

CPU time (the process's work) is steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("generate", "update", "memory"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def _model(args, *, lora: bool):
    """The medium model (vocab 512), with adapters of rank r (alpha 2r, all-linear) when ``lora``."""
    from fsdptrain.model.loading import TINY_CONFIG, build_full_model
    from fsdptrain.model.lora import LoraSettings

    config = {**TINY_CONFIG, "vocab_size": 512, "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4}
    settings = LoraSettings(r=args.r, alpha=2.0 * args.r, dropout=0.0) if lora else None
    return build_full_model("policy", path=None, config=config, seed=0, lora=settings)


SHAPES = {  # the published shapes of two 7B-class models: untied head, no biases
    "7B (Llama-2-7B shape)": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                              "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 32, "tie_word_embeddings": False},
    "8B (Llama-3-8B shape)": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "tie_word_embeddings": False},
}


def memory_ratio(config: dict, *, r: int) -> dict:
    """Base and adapter parameter counts of ``config`` with rank-``r`` all-linear adapters, and LoRA's training state
    over full fine-tuning's (bf16 params), without and with a KL reference:

        ratio    = (2 N + 16 A) / (16 N)          N base parameters, A adapter parameters
        ratio_kl = (2 N + 16 A) / (16 N + 2 N)    full fine-tuning's reference copy in bf16; LoRA's is the policy
    """
    from fsdptrain.model.loading import meta_model, resolve_config
    from fsdptrain.model.lora import LoraSettings

    model = meta_model("policy", resolve_config(path=None, config=config),
                       lora=LoraSettings(r=r, alpha=2.0 * r, dropout=0.0))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lora_bytes = 2 * base + 16 * adapters
    return {"base": base, "adapters": adapters, "ratio": lora_bytes / (16 * base),
            "ratio_kl": lora_bytes / (18 * base)}


def memory(args) -> dict:
    from benchmarks.fsdp_memory import model_config

    medium = model_config(hidden=args.hidden, layers=args.layers, vocab=8192)
    shapes = {f"medium ({args.hidden} x {args.layers})": medium, **SHAPES}
    return {name: memory_ratio(config, r=args.r) for name, config in shapes.items()}


def generation(args, *, prompts: int = 32, new_tokens: int = 16) -> dict:
    from peft.tuners.lora import LoraLayer

    model = _model(args, lora=True).eval()
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    ids = torch.randint(3, 512, (prompts, 8), generator=torch.Generator().manual_seed(0))

    def generate() -> tuple[float, torch.Tensor]:
        best, out = float("inf"), None
        for _ in range(args.repeats):
            start = time.process_time()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
            best = min(best, time.process_time() - start)
        return best, out

    separate_s, separate = generate()
    start = time.process_time()
    for layer in layers:
        layer.merge()
    merge_s = time.process_time() - start
    merged_s, merged = generate()
    start = time.process_time()
    for layer in layers:
        layer.unmerge()
    merge_s += time.process_time() - start
    return {"separate_s": separate_s, "merged_s": merged_s, "merge_unmerge_s": merge_s,
            "speedup_with_merge": separate_s / (merged_s + merge_s), "same_tokens": bool(torch.equal(separate, merged))}


def random_policy_batch(seqs: int, length: int):
    """A mini-batch of ``seqs`` random sequences of ``length`` tokens (a quarter prompt) with PPO targets, and
    token-mean policy-loss settings: what the update benchmarks train on (benchmarks/moe.py too)."""
    from fsdptrain.rl.fused_loss import SeqTargets
    from fsdptrain.rl.pg_terms import PolicyLossSettings
    from fsdptrain.train.step import MiniBatch

    gen = torch.Generator().manual_seed(0)
    prompt_len = length // 4
    prompts = [torch.randint(3, 512, (prompt_len,), generator=gen).tolist() for _ in range(seqs)]
    responses = [torch.randint(3, 512, (length - prompt_len,), generator=gen).tolist() for _ in range(seqs)]
    targets = [SeqTargets(old_logprobs=torch.full((len(r),), -6.0), advantages=torch.randn(len(r), generator=gen))
               for r in responses]
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                  seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
                                  temperature=1.0, chunk_size=1024)
    return MiniBatch(prompts, responses, targets), settings


def update(args, *, seqs: int = 16, length: int = 64) -> dict:
    from fsdptrain.model.attention_switch import set_attention
    from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
    from fsdptrain.train.pack_losses import packed_policy_loss
    from fsdptrain.train.step import update_on_minibatch

    batch, settings = random_policy_batch(seqs, length)
    sides = {}
    for name in ("full", "lora"):
        model = _model(args, lora=name == "lora")
        set_attention(model, "sdpa_segments")
        sides[name] = (model, build_optimizer(model, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8))

    def one(name: str) -> float:
        model, optimizer = sides[name]
        start = time.process_time()
        update_on_minibatch(model, optimizer, batch, loss_fn=packed_policy_loss, settings=settings, dp_size=1,
                            loss_scale_factor=None, token_budget=2048, grad_clip=1.0, guard=NonFiniteGuard(3),
                            device=torch.device("cpu"))
        return time.process_time() - start

    best = {name: float("inf") for name in sides}
    for repeat in range(args.repeats + 1):
        for name in sides:
            seconds = one(name)
            if repeat > 0:  # the first is warm-up
                best[name] = min(best[name], seconds)
    return {"full_s": best["full"], "lora_s": best["lora"], "ratio": best["lora"] / best["full"]}


def main(argv=None) -> dict:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    result = {"generate": generation, "update": update, "memory": memory}[args.what](args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
