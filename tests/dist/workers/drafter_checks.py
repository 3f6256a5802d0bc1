"""Worker: the co-trained drafter on FSDP2 ranks against an independent single-process reference.

The ranks run the product path of `update_on_minibatch` with a drafter, step by step so the gradients can be read
before the steps: the agreed packs, the draft counts folded into the policy's all-reduce, `accumulate_gradients`
with `packed_policy_and_draft_loss`, then the policy's and the drafter's own clipped AdamW steps. The reference is
one process: the plain policy and the plain drafter (same seeds), each sequence alone through the per-sequence
oracle (`per_sequence_draft_loss`: full teacher logits sliced to the draft vocabulary, plain softmax), the global
draft counts worked out per sequence by hand, torch's clip and AdamW. Each rank writes, per agg mode, the drafter's
largest gradient and updated-weight differences relative to the reference, and whether the policy's gathered
gradients and updated weights are bit-identical (torch.equal) to those of the same step with the drafter off.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor

from fsdptrain.check.draft_per_sequence import per_sequence_draft_loss
from fsdptrain.distributed import world
from tests.dist.workers.report import dist_worker, option
from fsdptrain.distributed.fsdp import build_policy, gather_full_grads, gather_full_state_dict, shard_as_one_unit
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.loading import build_full_model
from fsdptrain.model.drafter import DraftVocab
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.train.cotrain import DrafterUpdate, global_normalizers_with_draft, local_draft_counts, refresh_drafter
from fsdptrain.distributed.collectives import plan_agreed
from fsdptrain.train.drafter_setup import plain_drafter
from fsdptrain.train.optim import NonFiniteGuard, build_optimizer
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.pack_losses import (
    CoTrainSettings,
    DraftLossSettings,
    packed_policy_and_draft_loss,
    packed_policy_loss,
)
from fsdptrain.train.step import MiniBatch, accumulate_gradients, local_counts, optimizer_step

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

VOCAB = 40
CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "tie_word_embeddings": True}
POLICY_SEED, DRAFTER_SEED = 5, 11
FEATURE_LAYERS = (0, 1, 2)
DRAFT_IDS = list(range(0, VOCAB, 2)) + [3, 7, 11]  # 23 of the 40 ids
NUM_SEQS = 7  # rank r of 2 gets the sequences i with i % 2 == r: 4 and 3
TOKEN_BUDGET = 24
LR, DRAFT_LR, DRAFT_CLIP = 1e-2, 3e-3, 0.05  # the clip is active: the drafter's norm is above it
LOSS_SCALE_FACTOR = 6.0
SETTINGS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, seq_level_ratio=False, kl_coef=0.0,
                kl_estimator="k3", entropy_coef=0.01, temperature=0.8, chunk_size=7)
LOSS_WEIGHT = 0.7
ADAM_EPS = 1e-3  # Adam's first step is lr * g / (|g| + eps): a larger eps keeps the gradient's accuracy in the update


def global_batch():
    gen = torch.Generator().manual_seed(0)
    prompts, responses, targets = [], [], []
    lengths = [(3, 5), (1, 1), (2, 7), (4, 1), (1, 8), (5, 3), (2, 0)]  # a 2-token sequence, an empty response
    for p, r in lengths[:NUM_SEQS]:
        prompts.append(torch.randint(0, VOCAB, (p,), generator=gen).tolist())
        responses.append(torch.randint(0, VOCAB, (r,), generator=gen).tolist())
        targets.append(SeqTargets(old_logprobs=-3.5 + 0.5 * torch.randn(r, generator=gen),
                                  advantages=torch.randn(r, generator=gen)))
    return prompts, responses, targets


def draft_counts_by_hand(prompts, responses, on: str) -> tuple[int, int]:
    """Position t of an n-token sequence with prompt P is scored when t + 2 < n and (on=response) t + 2 >= P."""
    tokens = seqs = 0
    for p, r in zip(prompts, responses):
        n = len(p) + len(r)
        scored = sum(1 for t in range(n) if t + 2 < n and (on == "all" or t + 2 >= len(p)))
        tokens, seqs = tokens + scored, seqs + (scored > 0)
    return tokens, seqs


def oracle_backward(policy, drafter, mode: str, on: str, batch) -> tuple[int, int]:
    """Backward of loss_weight * the per-sequence oracle's draft loss into `drafter` (`policy` the teacher), with the
    hand-worked global draft counts, which it returns."""
    prompts, responses, _ = batch
    tokens, seqs = draft_counts_by_hand(prompts, responses, on)
    norms = LossNormalizers(global_num_tokens=tokens, global_num_seqs=seqs, dp_size=1,
                            loss_scale_factor=LOSS_SCALE_FACTOR)
    loss, _ = per_sequence_draft_loss(policy, drafter, prompts, responses, norms=norms, agg_mode=mode, on=on,
                                      temperature=SETTINGS["temperature"])
    (LOSS_WEIGHT * loss).backward()
    return tokens, seqs


def reference(mode: str, on: str, batch):
    """The drafter's gradients and its weights after one clipped AdamW step, in one process."""
    policy = build_full_model("policy", path=None, config=CONFIG, seed=POLICY_SEED)
    vocab = DraftVocab.from_target_ids(DRAFT_IDS, VOCAB)
    drafter = plain_drafter(policy, vocab, feature_layers=FEATURE_LAYERS, init_head_from_policy=True,
                            seed=DRAFTER_SEED)
    tokens, seqs = oracle_backward(policy, drafter, mode, on, batch)
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), DRAFT_CLIP)
    build_optimizer(drafter, lr=DRAFT_LR, betas=(0.9, 0.999), weight_decay=0.0, eps=ADAM_EPS).step()
    return grads, before, {n: p.detach().clone() for n, p in drafter.named_parameters()}, [tokens, seqs]


def update_relative_error(after: dict, ref_before: dict, ref_after: dict) -> float:
    """||update - reference update|| / ||reference update|| (L2 over all weights; both start from ref_before):
    exactly 1.0 for a skipped step, 0.5 for a half-size one."""
    num = sum(((after[n] - ref_before[n]) - (ref_after[n] - ref_before[n])).pow(2).sum() for n in ref_after)
    den = sum((ref_after[n] - ref_before[n]).pow(2).sum() for n in ref_after)
    return float((num / den).sqrt())


def worst_relative(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    scale = max(v.abs().max().item() for v in want.values())
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want) / scale


def policy_step(info, mesh, mini, mode: str, on: str, with_drafter: bool) -> dict:
    """One mini-batch of the product path; the gathered gradients and updated weights."""
    policy = build_policy(path=None, config=CONFIG, seed=POLICY_SEED, mesh=mesh)
    set_attention(policy, "sdpa_segments")
    settings = PolicyLossSettings(agg_mode=mode, **SETTINGS)
    plan = plan_agreed(mini.lengths(), TOKEN_BUDGET)
    out = {}
    if with_drafter:
        drafter = plain_drafter(policy, DraftVocab.from_target_ids(DRAFT_IDS, VOCAB), feature_layers=FEATURE_LAYERS,
                                init_head_from_policy=True, seed=DRAFTER_SEED)
        shard_as_one_unit(drafter, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                          device=info.device)
        draft_counts = local_draft_counts(mini.prompts, mini.responses, plan, on=on)
        norms, draft_norms = global_normalizers_with_draft(local_counts(mini), draft_counts, dp_size=world.dp_size(mesh),
                                                           loss_scale_factor=LOSS_SCALE_FACTOR)
        joint = CoTrainSettings(policy=settings, drafter=drafter, draft=DraftLossSettings(
            on=on, loss_weight=LOSS_WEIGHT, backend="sdpa_segments"), draft_norms=draft_norms)
        accumulate_gradients(policy, mini, loss_fn=packed_policy_and_draft_loss, settings=joint, norms=norms,
                             token_budget=TOKEN_BUDGET, device=info.device, plan=plan)
        out["draft_norms"] = [draft_norms.global_num_tokens, draft_norms.global_num_seqs]
    else:
        norms, _ = global_normalizers_with_draft(local_counts(mini), (0, 0), dp_size=world.dp_size(mesh),
                                                 loss_scale_factor=LOSS_SCALE_FACTOR)
        accumulate_gradients(policy, mini, loss_fn=packed_policy_loss, settings=settings, norms=norms,
                             token_budget=TOKEN_BUDGET, device=info.device, plan=plan)
    out["policy_grads"] = gather_full_grads(policy)
    optimizer_step(policy, build_optimizer(policy, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8),
                   grad_clip=1.0, guard=NonFiniteGuard(3))
    out["policy_weights"] = gather_full_state_dict(policy, rank0_only=False)
    if with_drafter:
        out["drafter_grads"] = gather_full_grads(drafter)
        optimizer = build_optimizer(drafter, lr=DRAFT_LR, betas=(0.9, 0.999), weight_decay=0.0, eps=ADAM_EPS)
        step = optimizer_step(drafter, optimizer, grad_clip=DRAFT_CLIP, guard=NonFiniteGuard(3))
        out["drafter_grad_norm"] = step.grad_norm
        weights = gather_full_state_dict(drafter, rank0_only=False)
        out["drafter_weights"] = {n: weights[n] for n in out["drafter_grads"]}
        out.update(refresh_step(info, policy, drafter, mini, joint, plan))
    return out


def refresh_step(info, policy, drafter, mini, joint: CoTrainSettings, plan) -> dict:
    """One refresh pass of the product (`refresh_drafter`) after the steps, with plain SGD at lr 1 and no clip, so
    the drafter's weights move by minus the pass's gradient; the policy's weights after it, and whether its root
    unit was resharded (every parameter a DTensor again)."""
    update = DrafterUpdate(module=drafter, optimizer=torch.optim.SGD(drafter.parameters(), lr=1.0), grad_clip=0.0,
                           guard=NonFiniteGuard(3), loss=joint.draft, refresh_passes=1)
    refresh_drafter(policy, mini, update, settings=joint, plan=plan, token_budget=TOKEN_BUDGET, device=info.device)
    weights = gather_full_state_dict(drafter, rank0_only=False)
    return {"refreshed_weights": {n: weights[n] for n in dict(drafter.named_parameters())},
            "policy_resharded": all(isinstance(p, DTensor) for p in policy.parameters()),
            "policy_weights_after_refresh": gather_full_state_dict(policy, rank0_only=False)}


def refresh_reference(mode: str, on: str, batch, on_run: dict) -> dict:
    """The refresh pass's gradient in one process: the per-sequence oracle with the ranks' UPDATED policy as the
    teacher and their drafter after its joint step."""
    policy = build_full_model("policy", path=None, config=CONFIG, seed=POLICY_SEED)
    policy.load_state_dict(on_run["policy_weights"])
    drafter = plain_drafter(policy, DraftVocab.from_target_ids(DRAFT_IDS, VOCAB), feature_layers=FEATURE_LAYERS,
                            init_head_from_policy=False, seed=DRAFTER_SEED)
    drafter.load_state_dict(on_run["drafter_weights"], strict=False)
    oracle_backward(policy, drafter, mode, on, batch)
    return {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}


def run_mode(mode: str, on: str, info, mesh, batch) -> dict:
    prompts, responses, targets = batch
    mine = [i for i in range(NUM_SEQS) if i % info.world_size == info.rank]
    mini = MiniBatch([prompts[i] for i in mine], [responses[i] for i in mine], [targets[i] for i in mine])
    ref_grads, ref_before, ref_weights, ref_counts = reference(mode, on, batch)
    on_run = policy_step(info, mesh, mini, mode, on, with_drafter=True)
    off_run = policy_step(info, mesh, mini, mode, on, with_drafter=False)
    same_grads = all(torch.equal(on_run["policy_grads"][n], off_run["policy_grads"][n]) for n in off_run["policy_grads"])
    same_weights = all(torch.equal(on_run["policy_weights"][n], off_run["policy_weights"][n])
                       for n in off_run["policy_weights"])
    refresh_steps = {n: on_run["drafter_weights"][n] - w for n, w in on_run["refreshed_weights"].items()}
    refreshed_policy = on_run["policy_weights_after_refresh"]
    return {
        "drafter_grad_rel": worst_relative(on_run["drafter_grads"], ref_grads),
        "drafter_weight_rel": worst_relative(on_run["drafter_weights"], ref_weights),
        "drafter_update_rel": update_relative_error(on_run["drafter_weights"], ref_before, ref_weights),
        "drafter_grad_norm": on_run["drafter_grad_norm"],
        "draft_norms": on_run["draft_norms"],
        "reference_counts": ref_counts,
        "policy_grads_identical": same_grads and set(on_run["policy_grads"]) == set(off_run["policy_grads"]),
        "policy_weights_identical": same_weights,
        "num_policy_grads": len(off_run["policy_grads"]),
        "num_local_seqs": len(mine),
        "refresh_grad_rel": worst_relative(refresh_steps, refresh_reference(mode, on, batch, on_run)),
        "refresh_left_policy": all(torch.equal(refreshed_policy[n], w) for n, w in on_run["policy_weights"].items()),
        "refresh_resharded_policy": on_run["policy_resharded"],
    }


@dist_worker(option("--modes", default=",".join(AGG_MODES)), traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = {}
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    batch = global_batch()
    for mode in args.modes.split(","):
        out["results"][f"{mode}/response"] = run_mode(mode, "response", info, mesh, batch)
    out["results"]["token-mean/all"] = run_mode("token-mean", "all", info, mesh, batch)


if __name__ == "__main__":
    main()
