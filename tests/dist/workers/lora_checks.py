"""Worker: LoRA adapters on FSDP2 ranks (docs/lora.md), against single-process peft models.

In one launch, every rank:

- steps: for every agg mode, the policy's adapters and the critic's (adapters + value head) take one product-path
  step (packed micro-batches, global normalisers, FSDP2's mean over ranks) from adapters whose ``lora_B`` was moved
  off zero, against the unsharded peft model on the whole padded batch (the reference of train_step_checks.py);
  again with activation checkpointing and on an HSDP mesh (2 replicas of 1 shard) for one mode. Frozen weights must
  hold no gradient and no optimizer state.
- reference: the policy with its adapters disabled gives the base model's logits; after it, the adapters train again;
  ``build_models`` with a KL loss allocates no second copy (unique parameter count).
- export: the adapter folder (``PeftModel.from_pretrained`` on the exported base) and the merged folder give the
  sharded model's logits; generation with and without gathered weights gives the unsharded peft model's tokens.
- checkpoint: an adapter-only checkpoint (size against a full fine-tuning one) restores adapters and optimizer state
  exactly into a freshly built model.

Each rank writes its numbers to <out>/rank<r>.json; tests/dist/test_lora.py asserts on them.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdptrain.distributed import world
from fsdptrain.distributed.sharded_checkpoint import load_checkpoint, save_checkpoint
from fsdptrain.distributed.export import export_lora
from fsdptrain.distributed.fsdp import (
    adapters_disabled,
    build_policy,
    build_value_model,
    gather_full_grads,
    gather_full_state_dict,
)
from fsdptrain.model.attention_switch import generation_attention, set_attention
from fsdptrain.model.loading import TINY_CONFIG, build_full_model, trainable_parameters
from fsdptrain.model.lora import LoraSettings
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.fused_loss import ValueLossSettings
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
from fsdptrain.train.pack_losses import packed_policy_loss, packed_value_loss
from fsdptrain.train.step import MiniBatch, accumulate_gradients, global_normalizers, optimizer_step
from tests.dist.workers.report import dist_worker
from tests.dist.workers.train_step_checks import (
    CONFIG,
    LOSS_SCALE_FACTOR,
    LR,
    NUM_SEQS,
    POLICY_SEED,
    SETTINGS,
    TOKEN_BUDGET,
    VALUE_SEED,
    global_batch,
    reference_step,
    update_relative_error,
    worst_relative,
)

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0)
CRITIC_LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), trainable_head=True)
PROMPTS = ["3 + 4 =", "repeat 7:", "hello", "9 9 9"]


def nudged(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every ``lora_B`` drawn from ``seed`` (peft starts them at zero, where ``lora_A`` gets no
    gradient and disabling the adapters would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def plain(kind: str, config: dict, seed: int, lora: LoraSettings) -> torch.nn.Module:
    """The unsharded peft model (adapters nudged): what every rank loads into its sharded one."""
    return nudged(build_full_model(kind, path=None, config=config, seed=seed, lora=lora), seed + 100)


def sharded(kind: str, config: dict, seed: int, lora: LoraSettings, mesh, reference: torch.nn.Module, **options):
    build = build_policy if kind == "policy" else build_value_model
    model = build(path=None, config=config, seed=seed, mesh=mesh, lora=lora, **options)
    set_model_state_dict(model, dict(reference.state_dict()), options=StateDictOptions(full_state_dict=True))
    return model


def product_step(model, kind: str, mode: str, info, mesh, batch):
    """This rank's share through the trainer's path; gradients, weights before and after, and the optimizer."""
    prompts, responses, targets = batch
    mine = [i for i in range(NUM_SEQS) if i % info.world_size == info.rank]
    mini = MiniBatch([prompts[i] for i in mine], [responses[i] for i in mine], [targets[i] for i in mine])
    if kind == "policy":
        loss_fn, settings = packed_policy_loss, PolicyLossSettings(agg_mode=mode, **SETTINGS)
    else:
        loss_fn, settings = packed_value_loss, ValueLossSettings(agg_mode=mode, cliprange_value=0.2)
    set_attention(model, "sdpa_segments")
    norms = global_normalizers(mini, dp_size=world.dp_size(mesh), loss_scale_factor=LOSS_SCALE_FACTOR)
    accumulate_gradients(model, mini, loss_fn=loss_fn, settings=settings, norms=norms, token_budget=TOKEN_BUDGET,
                         device=info.device)
    frozen_grads = sum(1 for p in model.parameters() if not p.requires_grad and p.grad is not None)
    grads = gather_full_grads(model)
    # cloned: with one shard per replica (HSDP 2x1) the gathered tensors are the parameters themselves
    before = {name: tensor.clone() for name, tensor in gather_full_state_dict(model, rank0_only=False).items()}
    optimizer = build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)
    optimizer_step(model, optimizer, grad_clip=0.0, guard=NonFiniteGuard(3))
    return grads, before, gather_full_state_dict(model, rank0_only=False), optimizer, frozen_grads


def step_check(kind: str, mode: str, info, mesh, batch, counts, **options) -> dict:
    config_seed = POLICY_SEED if kind == "policy" else VALUE_SEED
    lora = LORA if kind == "policy" else CRITIC_LORA
    reference = plain(kind, CONFIG, config_seed, lora)
    model = sharded(kind, CONFIG, config_seed, lora, mesh, reference, **options)
    grads, before, after, optimizer, frozen_grads = product_step(model, kind, mode, info, mesh, batch)
    ref_grads, ref_before, ref_after = reference_step(reference, kind, mode, batch, counts)
    state_params = sum(p.numel() for p in optimizer.state)  # sharded numel of the parameters with AdamW state
    trainable = trainable_parameters(model)
    return {
        "frozen_dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}),
        "trainable_dtypes": sorted({str(p.dtype) for p in trainable}),
        "grad_rel": worst_relative(grads, ref_grads),
        "update_rel": update_relative_error(before, after, ref_before, ref_after),
        "grad_names": sorted(grads),
        "frozen_grads": frozen_grads,
        "optimizer_params": len(optimizer.state), "trainable_params": len(trainable),
        "optimizer_numel": state_params, "trainable_numel": sum(p.numel() for p in trainable),
        "frozen_changed": sum(int(not torch.equal(before[n], after[n])) for n in before
                              if "lora_" not in n and not n.startswith("score")),
    }


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def reference_and_export(info, mesh, out: Path, tokenizer) -> dict:
    """The adapters disabled, export, generation and checkpoint checks on the tiny policy of the bundled tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdptrain.generation.generate import generate_responses
    from fsdptrain.generation.gather import gathered_weights

    config = {**TINY_CONFIG, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    results: dict = {}
    reference = plain("policy", config, 3, LORA)
    model = sharded("policy", config, 3, LORA, mesh, reference)
    base = build_full_model("policy", path=None, config=config, seed=3)
    ids = torch.tensor([tokenizer.encode("repeat 3 = 3 3 3 and 9 + 1")])
    adapted = logits_of(model, ids)
    with adapters_disabled(model):
        disabled = logits_of(model, ids)
    results["adapters_matter"] = float((adapted - logits_of(base, ids)).abs().max())
    results["disabled_vs_base"] = float((disabled - logits_of(base, ids)).abs().max())
    results["enabled_again_vs_before"] = float((logits_of(model, ids) - adapted).abs().max())
    results["trainable_after_disable"] = [bool(p.requires_grad) for n, p in model.named_parameters() if "lora_" in n]
    model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    results["adapter_grads_after_disable"] = len(gather_full_grads(model))
    results["num_adapter_tensors"] = sum(1 for n, _ in model.named_parameters() if "lora_" in n)
    model.zero_grad(set_to_none=True)

    export = out / "export"
    export_lora(model, export / "merged", adapter_dir=export / "adapter", base_dir=export / "base", base_path=None,
                tokenizer=tokenizer)
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(export / "base"), export / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(export / "merged")
    results["export_adapter_vs_trained"] = float((logits_of(with_peft, ids) - adapted).abs().max())
    results["export_merged_vs_trained"] = float((logits_of(merged, ids) - adapted).abs().max())
    results["export_adapter_class"] = type(with_peft).__name__

    device = torch.device("cpu")
    for sampling in (False, True):
        want = generate_responses(with_peft, tokenizer, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                  do_sample=sampling, generator_seed=77, device=device)
        for gather in (False, True):
            with generation_attention(model), gathered_weights(model, enabled=gather, reshard_after_forward=True):
                got = generate_responses(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                         do_sample=sampling, generator_seed=77, device=device)
            results[f"tokens_equal/sampled={sampling}/gather={gather}"] = got == want
            results[f"num_tokens/sampled={sampling}"] = sum(len(r) for _, r, _ in want)
    results.update(checkpoint_check(model, config, mesh, out, ids, reference))
    return results


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _saved_elements(path: Path) -> dict[str, int]:
    """Tensor elements the checkpoint holds, by top-level part (models, optimizers)."""
    import math

    from fsdptrain.storage.checkpoint_folders import read_dcp_metadata

    out: dict[str, int] = {}
    for key, item in read_dcp_metadata(path).state_dict_metadata.items():
        if hasattr(item, "size"):
            out[key.split(".")[0]] = out.get(key.split(".")[0], 0) + math.prod(item.size)
    return out


def checkpoint_check(model, config, mesh, out: Path, ids, reference) -> dict:
    """Step, save, build a fresh model, load: the same adapters and AdamW state, the same next step."""
    optimizer = build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)

    def step(m, opt):
        m(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
        optimizer_step(m, opt, grad_clip=1.0, guard=NonFiniteGuard(3))

    step(model, optimizer)
    saved = save_checkpoint(out / "run_lora", 1, models={"policy": model}, optimizers={"policy": optimizer},
                            schedulers={}, extra={})
    fresh = build_policy(path=None, config=config, seed=3, mesh=mesh, lora=LORA)  # adapters at init, not nudged
    fresh_optimizer = build_optimizer(fresh, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)
    load_checkpoint(saved, models={"policy": fresh}, optimizers={"policy": fresh_optimizer}, schedulers={})
    restored_equal = all(torch.equal(a, b) for a, b in zip(gather_full_state_dict(model, rank0_only=False).values(),
                                                            gather_full_state_dict(fresh, rank0_only=False).values()))
    step(model, optimizer)
    step(fresh, fresh_optimizer)
    next_equal = all(torch.equal(a, b) for a, b in zip(gather_full_state_dict(model, rank0_only=False).values(),
                                                       gather_full_state_dict(fresh, rank0_only=False).values()))
    full = build_policy(path=None, config=config, seed=3, mesh=mesh)
    full_optimizer = build_optimizer(full, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-3)
    step(full, full_optimizer)
    full_saved = save_checkpoint(out / "run_full", 1, models={"policy": full}, optimizers={"policy": full_optimizer},
                                 schedulers={}, extra={})
    return {"checkpoint_restored_equal": restored_equal, "checkpoint_next_step_equal": next_equal,
            "checkpoint_bytes_lora": _dir_bytes(saved), "checkpoint_bytes_full": _dir_bytes(full_saved),
            "checkpoint_elements_lora": _saved_elements(saved), "checkpoint_elements_full": _saved_elements(full_saved),
            "trainable_numel": sum(p.numel() for p in trainable_parameters(model)),
            "all_numel": sum(p.numel() for p in model.parameters()),
            "full_numel": sum(p.numel() for p in full.parameters())}


def no_reference_copy(mesh, info) -> dict:
    """Unique parameters held by build_models with a KL loss: LoRA (reference = the policy without adapters) against
    full fine-tuning (a frozen copy)."""
    from fsdptrain.config.compose import compose_config
    from fsdptrain.data.tokenizer import load_bundled_tokenizer
    from fsdptrain.train.setup import build_models

    out = {}
    for name, extra in (("lora", ["model.lora.r=8"]), ("full", [])):
        cfg = compose_config(["algorithm=grpo", "algorithm.use_kl_loss=true", *extra])
        models = build_models(cfg, load_bundled_tokenizer(), mesh, info.device, num_steps=1)
        held = {id(p): p.numel() for m in (models.policy, models.reference.model) for p in m.parameters()}
        out[f"{name}/unique_params"] = sum(held.values())
        out[f"{name}/policy_params"] = sum(p.numel() for p in models.policy.parameters())
        out[f"{name}/reference_is_policy"] = models.reference.model is models.policy
    return out


@dist_worker(traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = {}
    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    batch = global_batch()
    counts = (sum(len(r) for r in batch[1]), NUM_SEQS)
    results, seconds = out["results"], {}
    start = time.perf_counter()
    for mode in AGG_MODES:
        results[f"plain/policy/{mode}"] = step_check("policy", mode, info, mesh, batch, counts)
    results["plain/value/seq-mean-token-mean"] = step_check("value", "seq-mean-token-mean", info, mesh, batch,
                                                            counts)
    results["checkpointing/policy/token-mean"] = step_check("policy", "token-mean", info, mesh, batch, counts,
                                                            activation_checkpointing=True)
    results["bf16/policy/token-mean"] = step_check("policy", "token-mean", info, mesh, batch, counts,
                                                   param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hsdp = world.build_mesh(dp_replicate=2, dp_shard=None, device_type="cpu")
    results["hsdp/policy/seq-mean-token-sum-norm"] = step_check("policy", "seq-mean-token-sum-norm", info, hsdp,
                                                                batch, counts)
    seconds["steps"] = time.perf_counter() - start
    results["model"] = reference_and_export(info, mesh, args.out, load_bundled_tokenizer())
    seconds["model"] = time.perf_counter() - start - seconds["steps"]
    results["build_models"] = no_reference_copy(mesh, info)
    seconds["build_models"] = time.perf_counter() - start - seconds["steps"] - seconds["model"]
    results["seconds"] = seconds


if __name__ == "__main__":
    main()
