"""Worker: FSDP2 models, clipping, the optimizer step and the non-finite guard against a single-process reference.

Run under torchrun (any world size) or as a plain process (a world of one); `--device cuda` runs the sharded
models on GPUs (the reference stays on the CPU). Every rank builds the reference itself:
the plain transformers model from the same seed on the CPU, the whole global batch, loss = sum / global count.
Each rank holds an uneven share of the batch, in micro-batches whose count is agreed world-wide (a rank with fewer
sequences runs a dummy sequence with an all-zero mask), with per-micro-batch loss
sum(per-token loss on its sequences) / global count * dp_size; FSDP2 averages the gradients over the dp ranks.
Every rank writes its findings to <out>/rank<r>.json; the pytest side asserts on them.

Legend: _BT padded [batch, time].
"""

from __future__ import annotations

import hashlib
import math
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig

from fsdptrain.distributed import world
from fsdptrain.distributed import fsdp as models
from fsdptrain.model import loading as model_build
from fsdptrain.train import optim
from tests.dist.workers.report import dist_worker, option

VOCAB, SEQ_LEN = 128, 12
LENGTHS = [12, 7, 10, 3, 9]  # valid tokens of each global sequence; targets are tokens 1..len-1
SPLITS = {1: [[0, 1, 2, 3, 4]], 2: [[0, 1, 2], [3, 4]], 4: [[0, 1], [2], [3], [4]]}
POLICY_SEED, VALUE_SEED = 11, 23
LR, CLIP_FRACTION = 1e-2, 0.5
# Adam's first update is lr * g / (|g| + eps): with eps 1e-8 a 1e-8 rounding difference in a near-zero gradient
# moves the weight by up to lr. eps 1e-3 bounds the update's sensitivity to lr / eps = 10 x the gradient error.
ADAM_EPS = 1e-3


def llama_config(tied: bool) -> dict:
    return {**model_build.TINY_CONFIG, "tie_word_embeddings": tied}


def global_batch():
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, VOCAB, (len(LENGTHS), SEQ_LEN), generator=gen)
    mask_BT = torch.zeros(len(LENGTHS), SEQ_LEN - 1)
    for i, length in enumerate(LENGTHS):
        mask_BT[i, : length - 1] = 1.0
    value_targets_BT = torch.randn(len(LENGTHS), SEQ_LEN, generator=gen)
    return ids_BT, mask_BT, value_targets_BT


def micro_batches(rank: int, world_size: int) -> list[list[int]]:
    """This rank's sequences in 2 micro-batches where it has 2+, padded to the agreed count with [] (dummy)."""
    mine = SPLITS[world_size][rank]
    local = [mine[: (len(mine) + 1) // 2], mine[(len(mine) + 1) // 2 :]] if len(mine) > 1 else [mine]
    num_micro = world.agree_max_int(len(local))
    return local + [[]] * (num_micro - len(local))


def select(rows: list[int], ids_BT, mask_BT, targets_BT, device: torch.device):
    if rows:
        picked = ids_BT[rows], mask_BT[rows], targets_BT[rows]
    else:
        # The dummy: one real-looking sequence whose mask is all zero, so it adds 0 to the loss and the gradient.
        picked = ids_BT[:1], torch.zeros_like(mask_BT[:1]), targets_BT[:1]
    return tuple(t.to(device) for t in picked)


def token_ce_BT(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    logits = logits_BTV[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids_BT[:, 1:].reshape(-1), reduction="none").view(
        ids_BT.shape[0], -1
    )


def policy_logits(model, ids_BT: torch.Tensor, pattern: str) -> torch.Tensor:
    if pattern == "logits":
        return model(ids_BT, use_cache=False).logits
    # The fused loss's access pattern: root forward for hidden states, then the projection with the head's weight.
    out = model(ids_BT, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    weight = models.output_projection_weight(model)
    return out.hidden_states[-1] @ weight.t()


def policy_loss(model, ids_BT, mask_BT, *, pattern: str, global_num_tokens: float, dp: int) -> torch.Tensor:
    ce_BT = token_ce_BT(policy_logits(model, ids_BT, pattern), ids_BT)
    return (ce_BT * mask_BT).sum() / global_num_tokens * dp


def value_loss(model, ids_BT, mask_BT, targets_BT, *, global_num_tokens: float, dp: int) -> torch.Tensor:
    values_BT = model(ids_BT, use_cache=False).logits.squeeze(-1)[:, :-1].float()
    return (((values_BT - targets_BT[:, :-1]) ** 2) * mask_BT).sum() / global_num_tokens * dp


# ---------------------------------------------------------------------------------------------------------------
# Reference: plain transformers, one process, whole batch
# ---------------------------------------------------------------------------------------------------------------


def reference_policy(tied: bool):
    torch.manual_seed(POLICY_SEED)
    return AutoModelForCausalLM.from_config(LlamaConfig(**_fields(llama_config(tied))))


def reference_value(tied: bool):
    policy = reference_policy(tied)
    torch.manual_seed(VALUE_SEED)
    value = AutoModelForTokenClassification.from_config(LlamaConfig(**_fields(llama_config(tied)), num_labels=1))
    value.model.load_state_dict(policy.model.state_dict())
    return value.eval()  # eval: the reference's classifier dropout (0.1 by default) off


def _fields(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "model_type"}


def reference_step(model, loss_fn):
    """Gradients, clipped gradients, norm and the weights after one AdamW step, for the whole batch."""
    loss_fn(model).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_FRACTION * norm)
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.01, eps=ADAM_EPS)
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return {"grads": grads, "norm": norm, "clipped": clipped, "weights": weights}


# ---------------------------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------------------------


def compare(got: dict, want: dict) -> dict:
    """Largest element-wise |got - want| over all tensors and the largest |want| (the tolerance's scale)."""
    keys_match = sorted(got) == sorted(want)
    common = [k for k in want if k in got]
    err = max(float((got[k].float() - want[k].float()).abs().max()) for k in common)
    scale = max(float(want[k].abs().max()) for k in common)
    return {"keys_match": keys_match, "err": err, "scale": scale}


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def offload_policies(model) -> list[str]:
    return sorted(
        {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in model.modules()
         if isinstance(m, FSDPModule)}
    )


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------

VARIANTS = {
    "tied": dict(tied=True, pattern="chunk"),
    "untied": dict(tied=False, pattern="chunk"),
    "untied_logits": dict(tied=False, pattern="logits"),
    "tied_ac": dict(tied=True, pattern="chunk", activation_checkpointing=True),
    "untied_no_reshard": dict(tied=False, pattern="chunk", reshard_after_forward=False),
    "tied_ac_no_reshard": dict(tied=True, pattern="chunk", activation_checkpointing=True, reshard_after_forward=False),
    "tied_bf16": dict(tied=True, pattern="chunk", param_dtype=torch.bfloat16),
    "untied_bf16": dict(tied=False, pattern="chunk", param_dtype=torch.bfloat16),
    # pin_memory is off without an accelerator, so CPU offload also runs (slowly) on a CPU mesh.
    "tied_offload": dict(tied=True, pattern="chunk", cpu_offload=True),
}


def check_policy(variant: dict, *, mesh, info, refs: dict) -> dict:
    tied, pattern = variant["tied"], variant["pattern"]
    dp = world.dp_size(mesh)
    ids_BT, mask_BT, targets_BT = global_batch()
    global_num_tokens = float(mask_BT.sum())
    if tied not in refs:
        refs[tied] = reference_step(
            reference_policy(tied),
            lambda m: policy_loss(m, ids_BT, mask_BT, pattern="logits", global_num_tokens=global_num_tokens, dp=1),
        )
    ref = refs[tied]
    model = models.build_policy(
        path=None,
        config=llama_config(tied),
        seed=POLICY_SEED,
        mesh=mesh,
        param_dtype=variant.get("param_dtype", torch.float32),
        reduce_dtype=torch.float32,
        reshard_after_forward=variant.get("reshard_after_forward", True),
        activation_checkpointing=variant.get("activation_checkpointing", False),
        cpu_offload=variant.get("cpu_offload", False),
    )
    out = {
        "offload_policies": offload_policies(model),
        "tied_after_shard": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
    }
    initial = models.gather_full_state_dict(model, rank0_only=False)
    out["initial_weights_digest"] = digest(initial)
    ref_initial = reference_policy(tied).state_dict()
    out["initial_weights"] = compare(initial, ref_initial)
    out["forwards"] = 0
    for rows in micro_batches(info.rank, info.world_size):
        ids, mask, _ = select(rows, ids_BT, mask_BT, targets_BT, info.device)
        policy_loss(model, ids, mask, pattern=pattern, global_num_tokens=global_num_tokens, dp=dp).backward()
        out["forwards"] += 1
    out["grads"] = compare(models.gather_full_grads(model), ref["grads"])
    norm = optim.clip_grad_norm_(model.parameters(), CLIP_FRACTION * ref["norm"])
    out["norm"], out["ref_norm"] = float(norm), ref["norm"]
    out["clipped"] = compare(models.gather_full_grads(model), ref["clipped"])
    opt = optim.build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.01, eps=ADAM_EPS)
    opt.step()
    opt.zero_grad()
    out["stepped_weights"] = compare(models.gather_full_state_dict(model, rank0_only=False), ref["weights"])
    if variant is VARIANTS["tied"]:
        out["nonfinite_skip"] = check_nonfinite_skip(model, opt, mesh=mesh, info=info)
        out["memory"] = model_build.describe_model_memory(model, num_shards=dp)
    return out


def check_nonfinite_skip(model, opt, *, mesh, info) -> dict:
    """A NaN planted in the last rank's local gradient shard: every rank must skip and keep its weights."""
    ids_BT, mask_BT, targets_BT = global_batch()
    global_num_tokens = float(mask_BT.sum())
    for rows in micro_batches(info.rank, info.world_size):
        ids, mask, _ = select(rows, ids_BT, mask_BT, targets_BT, info.device)
        loss = policy_loss(model, ids, mask, pattern="chunk", global_num_tokens=global_num_tokens,
                           dp=world.dp_size(mesh))
        loss.backward()
    if info.rank == info.world_size - 1:
        grad = model.get_input_embeddings().weight.grad
        grad.to_local().view(-1)[0] = float("nan")
    before = models.gather_full_state_dict(model, rank0_only=False)
    norm = optim.clip_grad_norm_(model.parameters(), 1.0)
    guard = optim.NonFiniteGuard(max_in_a_row=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped = guard.should_skip(norm)
    if not skipped:
        opt.step()
    opt.zero_grad()
    after = models.gather_full_state_dict(model, rank0_only=False)
    return {
        "norm_is_finite": math.isfinite(float(norm)),
        "skipped": skipped,
        "num_skipped": guard.num_skipped,
        "warned": any("non-finite gradient norm" in str(w.message) for w in caught),
        "weights_unchanged": all(torch.equal(before[k], after[k]) for k in before),
    }


def check_guard_stop(info) -> dict:
    """Rank-local norms (finite everywhere but on the last rank): the world-wide decision and the stop."""
    local_norm = float("inf") if info.rank == info.world_size - 1 else 1.0
    guard = optim.NonFiniteGuard(max_in_a_row=2)
    decisions = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decisions.append(guard.should_skip(local_norm))  # bad: 1 in a row
        decisions.append(guard.should_skip(2.0))  # good everywhere: resets the run
        decisions.append(guard.should_skip(local_norm))  # bad: 1 in a row again
        try:
            guard.should_skip(local_norm)  # bad: 2 in a row -> stop
            raised = None
        except optim.NonFiniteGradientError as exc:
            raised = str(exc)
    return {"decisions": decisions, "raised": raised, "num_skipped": guard.num_skipped}


def check_value(*, mesh, info, tied: bool) -> dict:
    dp = world.dp_size(mesh)
    ids_BT, mask_BT, targets_BT = global_batch()
    global_num_tokens = float(mask_BT.sum())
    ref_model = reference_value(tied)
    ref_model.zero_grad()
    value_loss(ref_model, ids_BT, mask_BT, targets_BT, global_num_tokens=global_num_tokens, dp=1).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    model = models.build_value_model(
        path=None, config=llama_config(tied), seed=VALUE_SEED, mesh=mesh,
        backbone_from_config=llama_config(tied), backbone_seed=POLICY_SEED,
    )
    out = {
        "initial_weights": compare(models.gather_full_state_dict(model, rank0_only=False), ref_model.state_dict()),
        "num_dropout_nonzero": sum(1 for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p != 0),
    }
    for rows in micro_batches(info.rank, info.world_size):
        ids, mask, targets = select(rows, ids_BT, mask_BT, targets_BT, info.device)
        value_loss(model, ids, mask, targets, global_num_tokens=global_num_tokens, dp=dp).backward()
    out["grads"] = compare(models.gather_full_grads(model), ref_grads)
    return out


def check_reference(*, mesh, info) -> dict:
    ref = models.build_reference_model(path=None, config=llama_config(True), seed=POLICY_SEED, mesh=mesh)
    # bf16 params: the reference stores its weights in bf16 (it never steps, so it needs no fp32 master copy) and
    # computes exactly what the policy computes from its fp32 master weights, which FSDP2 casts before gathering
    bf16 = dict(path=None, config=llama_config(True), seed=POLICY_SEED, mesh=mesh, param_dtype=torch.bfloat16)
    ref_bf16, policy_bf16 = models.build_reference_model(**bf16), models.build_policy(**bf16)
    bf16_stored_dtypes = sorted({str(p.dtype) for p in ref_bf16.parameters()})  # the shards, before any forward
    ids = torch.arange(3, 3 + SEQ_LEN, device=info.device).reshape(1, -1)
    with torch.no_grad():
        same_logits = torch.equal(ref_bf16(input_ids=ids).logits, policy_bf16(input_ids=ids).logits)
    return {
        "requires_grad": any(p.requires_grad for p in ref.parameters()),
        "training": ref.training,
        "initial_weights": compare(
            models.gather_full_state_dict(ref, rank0_only=False), reference_policy(True).state_dict()
        ),
        "bf16_stored_dtypes": bf16_stored_dtypes,
        "bf16_same_logits_as_policy": same_logits,
    }


@dist_worker(option("--dp-replicate", type=int, default=1), option("--variants", default=",".join(VARIANTS)),
             option("--extras", default="value,guard,reference"),
             option("--device", default="cpu", choices=["cpu", "cuda"]))
def main(args, info, results: dict) -> None:
    mesh = world.build_mesh(dp_replicate=args.dp_replicate, dp_shard=None, device_type=args.device)
    results.update({"world_size": info.world_size, "dp_size": world.dp_size(mesh), "mesh": list(mesh.mesh_dim_names)})
    refs: dict = {}
    for name in filter(None, args.variants.split(",")):
        results[name] = check_policy(VARIANTS[name], mesh=mesh, info=info, refs=refs)
    extras = set(filter(None, args.extras.split(",")))
    if "value" in extras:
        results["value"] = check_value(mesh=mesh, info=info, tied=True)
    if "guard" in extras:
        results["guard_stop"] = check_guard_stop(info)
    if "reference" in extras:
        results["reference"] = check_reference(mesh=mesh, info=info)


if __name__ == "__main__":
    main()
