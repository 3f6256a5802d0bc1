"""Worker: a run started from a saved drafter (`drafter.path`, an export/drafter/ folder) begins with exactly that
drafter.

A Trainer is built as `fsdptrain train` builds it, with the given config overrides (`drafter.path=...` among them);
then, before any update, this rank reports: whether the run's drafter (gathered) equals the folder's weights and
d2t/t2d bit for bit (`load_drafter`, cast to float32 as the trainer holds it), and its first mini-batch's drafter
metrics from the train step's own `update_on_minibatch` next to those of the per-sequence oracle run with the
folder's drafter loaded on its own (`per_sequence_draft_loss`, the draft counts by hand).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from fsdptrain.check.draft_per_sequence import per_sequence_draft_loss, sequence_draft_mask
from fsdptrain.config.compose import compose_config
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import gather_full_state_dict
from fsdptrain.model.drafter_export import load_drafter
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import finalize
from fsdptrain.train.rl import Trainer
from fsdptrain.train.pack_losses import packed_policy_loss
from fsdptrain.train.step import update_on_minibatch
from tests.dist.workers.report import dist_worker, option


def check(overrides: list[str], info, mesh) -> dict:
    cfg = compose_config(overrides)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()), info, mesh)
    saved = load_drafter(cfg.drafter.path).float()
    state = gather_full_state_dict(trainer.auxiliary_loss().module)
    want = saved.state_dict()
    same = set(state) == set(want) and all(torch.equal(state[k].cpu(), want[k]) for k in want)
    rollouts, _ = trainer.step_rollouts(0)
    targets, facts = trainer.make_experience(rollouts)
    batch = trainer.minibatches(rollouts, targets)[0]
    masks = [sequence_draft_mask(len(p), len(p) + len(r), cfg.drafter.on)
             for p, r in zip(batch.prompts, batch.responses)]
    norms = LossNormalizers(sum(int(m.sum()) for m in masks), sum(1 for m in masks if m.any()), dp_size=1,
                            loss_scale_factor=trainer.loss_scale_factor)
    settings = trainer.policy_settings
    _, oracle = per_sequence_draft_loss(trainer.models.policy, saved, batch.prompts, batch.responses, norms=norms,
                                        agg_mode=settings.agg_mode, on=cfg.drafter.on,
                                        temperature=settings.temperature)
    metrics, _ = update_on_minibatch(
        trainer.models.policy, trainer.models.policy_part.optimizer, batch, loss_fn=packed_policy_loss, settings=settings,
        dp_size=1, loss_scale_factor=trainer.loss_scale_factor, token_budget=cfg.trainer.token_budget,
        grad_clip=cfg.trainer.grad_clip, guard=trainer.models.policy_part.guard, device=trainer.device, auxiliary=trainer.auxiliary_loss())
    got = {k: v for k, v in finalize(metrics).items() if k.startswith("drafter/")}
    return {"weights_equal": same, "num_weights": len(want), "train_step": got, "oracle": finalize(oracle),
            "num_layers": trainer.auxiliary_loss().module.config.num_hidden_layers}


@dist_worker(option("overrides", nargs="*"), traceback_in_record=True)
def main(args, info, out: dict) -> None:
    out["results"] = None
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    out["results"] = check(args.overrides, info, mesh)


if __name__ == "__main__":
    main()
