"""The run directory's durable state: checkpoints of the whole trainer, resume, the final export.

See docs/checkpointing.md for what a checkpoint holds and what resuming reproduces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fsdptrain.config import ConfigError
from fsdptrain.distributed.checkpoint import checkpoint_info, load_checkpoint, newest_intact_checkpoint, save_checkpoint
from fsdptrain.distributed.export import export_hf
from fsdptrain.distributed.files import read_jsonl_dropping_partial_tail, write_atomic
from fsdptrain.rl.reward_scale import RunningMoments
from fsdptrain.train.drafter_setup import export_sharded_drafter, placeholder_vocab
from fsdptrain.train.progress import log
from fsdptrain.train.run_ownership import run_id

if TYPE_CHECKING:
    from fsdptrain.train.loop import Trainer


def _checkpoint_state(trainer: "Trainer") -> tuple[dict, dict, dict]:
    m = trainer.models
    models = {"policy": m.policy}
    optimizers = {"policy": m.policy_optimizer}
    schedulers = {"policy": m.policy_scheduler}
    if m.critic is not None:
        models["critic"], optimizers["critic"], schedulers["critic"] = m.critic, m.critic_optimizer, m.critic_scheduler
    if trainer.drafter is not None:  # its weights, d2t/t2d (buffers), optimizer and scheduler
        models["drafter"], optimizers["drafter"] = trainer.drafter.module, trainer.drafter.optimizer
        schedulers["drafter"] = trainer.drafter_scheduler
    return models, optimizers, schedulers


def save(trainer: "Trainer", run_dir: Path, done: int) -> Path:
    """A checkpoint after ``done`` steps (collective): models, optimizers, schedulers, counters; RNG per rank."""
    models, optimizers, schedulers = _checkpoint_state(trainer)
    extra = {
        "step": done,
        "data_position": done * trainer.cfg.rollout.prompts_per_step,  # prompt groups consumed
        "nonfinite": {"policy": [trainer.policy_guard.num_skipped, trainer.policy_guard.num_in_a_row],
                      "critic": [trainer.critic_guard.num_skipped, trainer.critic_guard.num_in_a_row]},
        "grad_norm_watch": [trainer.policy_watch.in_a_row, trainer.critic_watch.in_a_row],
    }
    order = getattr(trainer.source, "order", None)
    if order is not None:
        extra["prompt_order"] = order.state_dict()
    moments = getattr(trainer.source, "reward_moments", None)
    if moments:
        extra["reward_model_moments"] = [m.state_dict() for m in moments]
    if trainer.drafter is not None:
        extra["drafter_nonfinite"] = [trainer.drafter.guard.num_skipped, trainer.drafter.guard.num_in_a_row]
    if trainer.draft_counts is not None:  # the draft vocabulary is still being counted
        extra["draft_counts"] = trainer.draft_counts.clone()
    return save_checkpoint(run_dir, done, models=models, optimizers=optimizers, schedulers=schedulers, extra=extra,
                           keep=trainer.cfg.checkpoint.keep, run_id=run_id(run_dir))


def resume(trainer: "Trainer", run_dir: Path) -> int:
    """With ``trainer.resume=auto``, restore the newest intact checkpoint of the run's lineage (a damaged newer one is
    skipped with a warning); return the steps done."""
    if trainer.cfg.trainer.resume != "auto":
        return 0
    path = newest_intact_checkpoint(run_dir, run_id(run_dir))
    if path is None:
        log(f"trainer.resume=auto: no complete checkpoint in {run_dir}; starting fresh")
        return 0
    if "drafter" in checkpoint_info(path)["models"] and trainer.drafter is None:
        # the drafter's shapes, then the checkpoint's weights and d2t/t2d
        trainer.start_drafter(placeholder_vocab(trainer.cfg, trainer.models.policy.config.vocab_size))
    models, optimizers, schedulers = _checkpoint_state(trainer)
    extra = load_checkpoint(path, models=models, optimizers=optimizers, schedulers=schedulers)
    per_step = trainer.cfg.rollout.prompts_per_step
    if extra["data_position"] != extra["step"] * per_step:
        raise ConfigError(
            f"{path} consumed {extra['data_position']} prompt groups in {extra['step']} steps, which "
            f"rollout.prompts_per_step={per_step} does not give: resume with the run's own rollout.prompts_per_step")
    if extra["step"] > trainer.num_steps:
        given = (f"trainer.steps={trainer.cfg.trainer.steps}" if trainer.cfg.trainer.steps is not None
                 else f"trainer.epochs={trainer.cfg.trainer.epochs} ({trainer.num_steps} steps)")
        raise ConfigError(f"{path} is after step {extra['step']} but {given}: raise trainer.steps (or "
                          f"trainer.epochs) to continue this run")
    order = getattr(trainer.source, "order", None)
    if order is not None:
        if "prompt_order" not in extra:
            raise ConfigError(f"{path} holds no prompt order (it was saved by a run with another data.source)")
        order.load_state_dict(extra["prompt_order"])
    _restore_reward_moments(trainer, extra, path)
    trainer.policy_guard.num_skipped, trainer.policy_guard.num_in_a_row = extra["nonfinite"]["policy"]
    trainer.critic_guard.num_skipped, trainer.critic_guard.num_in_a_row = extra["nonfinite"]["critic"]
    trainer.policy_watch.in_a_row, trainer.critic_watch.in_a_row = extra["grad_norm_watch"]
    if trainer.drafter is not None:
        trainer.drafter.guard.num_skipped, trainer.drafter.guard.num_in_a_row = extra["drafter_nonfinite"]
    trainer.draft_counts = extra.get("draft_counts")
    log(f"resumed from {path} after step {extra['step']}")
    return int(extra["step"])


def _restore_reward_moments(trainer: "Trainer", extra: dict, path: Path) -> None:
    """The reward models' running moments (reward.model_normalize=running), one entry per reward model."""
    moments = getattr(trainer.source, "reward_moments", None)
    if not moments:
        return
    saved = extra.get("reward_model_moments", [])
    if len(saved) != len(moments):
        raise ConfigError(f"{path} holds running moments of {len(saved)} reward models, but reward.models lists "
                          f"{len(moments)}: resume with the run's own reward.models")
    trainer.source.reward_moments = [RunningMoments.from_state_dict(state) for state in saved]


def keep_metrics_before(path: Path, step: int) -> None:
    """Drop logged steps at or after ``step`` (they are about to be redone after a resume), and a partial last line
    left by a crash. The trimmed file is written beside the old one and renamed over it: a kill at any moment leaves
    the old file or the new one."""
    if path.exists():
        rows = [row for row in read_jsonl_dropping_partial_tail(path) if row["step"] < step]
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def export(trainer: "Trainer", run_dir: Path) -> None:
    """The final policy (and critic) as Hugging Face folders with safetensors and the tokenizer (collective)."""
    export_hf(trainer.models.policy, run_dir / "export" / "policy", tokenizer=trainer.tokenizer)
    if trainer.models.critic is not None:
        export_hf(trainer.models.critic, run_dir / "export" / "critic", tokenizer=trainer.tokenizer)
    if trainer.drafter is not None:
        export_sharded_drafter(trainer.drafter.module, run_dir / "export" / "drafter", trainer.models.policy.config,
                               dtype=trainer.cfg.drafter.export_dtype)
