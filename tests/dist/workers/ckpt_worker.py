"""Worker: checkpoints, exact resume, resume at another world size, a crash inside the writer, HF export.

A tiny training loop (policy: token-mean cross-entropy; critic: token-mean squared error against fixed targets;
AdamW each; a warmup-then-constant schedule, so a scheduler that is not restored changes the learning rate). The
global batch of step k is drawn from a generator seeded by the data position (sequences consumed so far), so the
data position must be restored for the losses to match; each step also draws once from torch's and python's global
RNGs (recorded), so RNG restoration shows in the draws. Each rank holds an equal slice of the global batch; its loss
is sum / global count * world size (FSDP2 averages gradients over the ranks), the logged loss sum / global count.

Phases (argv `--phase`), one per launch:
  train         run A: steps 1-6, a checkpoint after steps 1-4 (keep 3), export policy and critic after step 6
  resume_crash  load A/step_2, run steps 3-4, save into run B at step 4, run step 5, save at 5: the test's
                sitecustomize kills the process inside DCP's writer during that second save
  reshard       (2 ranks) resume from latest_checkpoint(B), run steps 5-6, save at step 6 (keep 2), export
Every rank writes <out>/rank<r>.json; rank 0 also writes tensors (optimizer state, export references) as .pt files.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch
import torch.distributed
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from fsdptrain.distributed import sharded_checkpoint as ckpt

from fsdptrain.storage import checkpoint_folders as folders
from fsdptrain.distributed import world
from fsdptrain.distributed import fsdp as models
from fsdptrain.train import optim
from fsdptrain.distributed.export import export_hf
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from tests.dist.workers.report import dist_worker, option

CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True,
}
POLICY_SEED, CRITIC_SEED = 5, 6
GLOBAL_BATCH, SEQ_LEN, VOCAB = 4, 10, 64
TOTAL_STEPS, WARMUP_STEPS = 6, 3
# Adam's update lr * m / (sqrt(v) + eps) with a larger eps stays smooth in near-zero gradients, so the 1e-9 rounding
# difference between 1 and 2 ranks does not flip a sign and move a weight by a whole lr (see fsdp_checks.py).
LR, ADAM_EPS = 1e-2, 1e-3


def build(mesh):
    policy = models.build_sharded_model("policy", path=None, config=CONFIG, seed=POLICY_SEED, mesh=mesh)
    critic = models.build_sharded_model("value", path=None, config=CONFIG, seed=CRITIC_SEED, mesh=mesh)
    trainables = {"policy": policy, "critic": critic}
    optimizers = {
        name: optim.build_optimizer(model, lr=LR, betas=(0.9, 0.999), weight_decay=0.01, eps=ADAM_EPS)
        for name, model in trainables.items()
    }
    schedulers = {
        name: optim.build_scheduler(
            opt, warmup_steps=WARMUP_STEPS, total_steps=TOTAL_STEPS, schedule="constant", min_lr_ratio=0.0
        )
        for name, opt in optimizers.items()
    }
    return trainables, optimizers, schedulers


def global_batch(data_position: int):
    gen = torch.Generator().manual_seed(1000 + data_position)
    ids_BT = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    targets_BT = torch.randn(GLOBAL_BATCH, SEQ_LEN, generator=gen)
    return ids_BT, targets_BT


def train_step(trainables, optimizers, schedulers, state: dict) -> dict:
    """One step of both models on this rank's slice of the global batch at state["data_position"]."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ids_BT, targets_BT = global_batch(state["data_position"])
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    ids_BT, targets_BT = ids_BT[rows], targets_BT[rows]
    global_num_tokens = GLOBAL_BATCH * (SEQ_LEN - 1)
    policy, critic = trainables["policy"], trainables["critic"]

    logits = policy(input_ids=ids_BT, use_cache=False).logits[:, :-1]
    ce_sum = F.cross_entropy(logits.reshape(-1, VOCAB), ids_BT[:, 1:].reshape(-1), reduction="sum")
    (ce_sum / global_num_tokens * world_size).backward()
    values = critic(input_ids=ids_BT, use_cache=False).logits[:, :-1, 0]
    se_sum = ((values - targets_BT[:, :-1]) ** 2).sum()
    (se_sum / global_num_tokens * world_size).backward()
    for name, opt in optimizers.items():
        optim.clip_grad_norm_(trainables[name].parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedulers[name].step()

    sums = torch.stack([ce_sum.detach(), se_sum.detach()]).double()
    torch.distributed.all_reduce(sums)
    state["data_position"] += GLOBAL_BATCH
    state["step"] += 1
    # One draw from each global RNG per step: they must continue identically after a resume.
    draws = [torch.rand(1).item(), random.random()]
    return {"step": state["step"], "pg_loss": sums[0].item() / global_num_tokens,
            "vf_loss": sums[1].item() / global_num_tokens, "draws": draws}


def full_optimizer_state(trainables, optimizers) -> dict:
    """Every optimizer's full (unsharded) state on every rank: {name: state dict with FQN keys}. Collective."""
    options = StateDictOptions(full_state_dict=True)
    return {
        name: get_optimizer_state_dict(trainables[name], opt, options=options) for name, opt in optimizers.items()
    }


def rng_fingerprint() -> dict:
    return {"torch": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "python": hashlib.sha256(repr(random.getstate()).encode()).hexdigest()}


def save(run_dir, trainables, optimizers, schedulers, state, keep):
    extra = {"step": state["step"], "data_position": state["data_position"], "num_nonfinite": state["step"] * 10,
             "note": ["plain", 1.5, None]}
    return ckpt.save_checkpoint(run_dir, state["step"], models=trainables, optimizers=optimizers,
                                schedulers=schedulers, extra=extra, keep=keep)


def phase_train(args, mesh, out: Path) -> dict:
    run_a = Path(args.run_a)
    trainables, optimizers, schedulers = build(mesh)
    state = {"step": 0, "data_position": 0}
    results: dict = {"steps": []}
    for _ in range(TOTAL_STEPS):
        results["steps"].append(train_step(trainables, optimizers, schedulers, state))
        if state["step"] <= 4:
            save(run_a, trainables, optimizers, schedulers, state, keep=3)
        if state["step"] == 2:
            results["rng_at_2"] = rng_fingerprint()
            full = full_optimizer_state(trainables, optimizers)
            if torch.distributed.get_rank() == 0:
                torch.save(full, out / "optim_at_2.pt")
    results["latest"] = str(folders.latest_checkpoint(run_a))
    export_both(trainables, run_a, out)
    return results


def export_both(trainables, run_dir: Path, out: Path) -> None:
    """Export policy and critic into run_dir/export/; rank 0 saves the trained models' outputs on a fixed batch."""
    export_hf(trainables["policy"], run_dir / "export" / "policy", tokenizer=load_bundled_tokenizer())
    export_hf(trainables["critic"], run_dir / "export" / "critic", tokenizer=load_bundled_tokenizer())
    ids_BT = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(77))
    with torch.no_grad():
        logits = trainables["policy"](input_ids=ids_BT, use_cache=False).logits
        values = trainables["critic"](input_ids=ids_BT, use_cache=False).logits
    if torch.distributed.get_rank() == 0:
        torch.save({"ids": ids_BT, "logits": logits, "values": values}, out / "export_ref.pt")


def phase_resume_crash(args, mesh, out: Path) -> dict:
    trainables, optimizers, schedulers = build(mesh)
    path = folders.checkpoint_dir(args.run_a, 2)
    extra = ckpt.load_checkpoint(path, models=trainables, optimizers=optimizers, schedulers=schedulers)
    results: dict = {"extra": extra, "rng_after_load": rng_fingerprint(), "steps": [],
                     "lr_after_load": {name: s.get_last_lr() for name, s in schedulers.items()}}
    full = full_optimizer_state(trainables, optimizers)
    if torch.distributed.get_rank() == 0:
        torch.save(full, out / "optim_after_load.pt")
    state = {"step": extra["step"], "data_position": extra["data_position"]}
    for _ in range(2):
        results["steps"].append(train_step(trainables, optimizers, schedulers, state))
    save(args.run_b, trainables, optimizers, schedulers, state, keep=2)
    results["steps"].append(train_step(trainables, optimizers, schedulers, state))
    # Written before the save the test's patch kills.
    Path(out, f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results, indent=1))
    save(args.run_b, trainables, optimizers, schedulers, state, keep=2)
    results["survived_the_crash"] = True
    return results


def phase_reshard(args, mesh, out: Path) -> dict:
    trainables, optimizers, schedulers = build(mesh)
    run_b = Path(args.run_b)
    path = folders.latest_checkpoint(run_b)
    extra = ckpt.load_checkpoint(path, models=trainables, optimizers=optimizers, schedulers=schedulers)
    results: dict = {"resumed_from": str(path), "extra": extra, "rng_after_load": rng_fingerprint(), "steps": [],
                     "temp_dirs_after_load": sorted(p.name for p in (run_b / "checkpoints").glob(".tmp_*"))}
    state = {"step": extra["step"], "data_position": extra["data_position"]}
    for _ in range(2):
        results["steps"].append(train_step(trainables, optimizers, schedulers, state))
    results["saved"] = str(save(run_b, trainables, optimizers, schedulers, state, keep=2))
    export_both(trainables, run_b, out)
    return results


PHASES = {"train": phase_train, "resume_crash": phase_resume_crash, "reshard": phase_reshard}


@dist_worker(option("--phase", required=True, choices=sorted(PHASES)), option("--run-a", required=True),
             option("--run-b", required=True))
def main(args, info, record: dict) -> None:
    torch.manual_seed(0)
    random.seed(0)
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    record.update(PHASES[args.phase](args, mesh, args.out))


if __name__ == "__main__":
    main()
