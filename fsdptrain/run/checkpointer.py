"""The run directory's durable state: checkpoints of every stateful part of the run, resume, the final export.

The checkpointer knows no part by its internals: it saves a :class:`Checkpointed` (models and optimizers, sharded
through DCP; schedulers; and named states, each an object with ``state_dict()`` / ``load_state_dict()``) and restores
the same dict. See docs/checkpointing.md for what a checkpoint holds and what resuming reproduces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from fsdptrain.config import ConfigError
from fsdptrain.distributed import world
from fsdptrain.distributed.sharded_checkpoint import CheckpointMismatch, load_checkpoint, save_checkpoint
from fsdptrain.storage.checkpoint_folders import (
    checkpoint_info,
    foreign_checkpoint,
    intact_checkpoint,
    lineage_of,
    warn_damaged,
)
from fsdptrain.distributed.export import export_hf, export_lora
from fsdptrain.storage.atomic import read_jsonl_dropping_partial_tail, write_atomic
from fsdptrain.model.lora import has_adapters
from fsdptrain.run.console import log
from fsdptrain.run.ownership import record_config_change, run_id

STATE_LAYOUT = 2
"""The layout of ``extra`` in trainer_state.pt: 2 holds ``states`` (name -> state dict). Layout 1 (no
``state_layout`` key: the counters written one by one) loads through :func:`states_of_layout_1`."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Checkpointed:
    """What a checkpoint holds of a run, by name."""

    models: dict = field(default_factory=dict)
    optimizers: dict = field(default_factory=dict)
    schedulers: dict = field(default_factory=dict)
    states: dict[str, Stateful] = field(default_factory=dict)
    """Plain state (counters, the prompt order, running moments, ...): saved by rank 0, the same on every rank."""


def rows_per_step(cfg) -> tuple[int, str]:
    """The rows a step consumes and the key that sets them: ``sft.rows_per_step`` demonstrations for fsdptrain sft,
    else ``rollout.prompts_per_step`` prompt groups."""
    if cfg.data.source == "sft":
        return cfg.sft.rows_per_step, "sft.rows_per_step"
    return cfg.rollout.prompts_per_step, "rollout.prompts_per_step"


def save(parts: Checkpointed, run_dir: Path, done: int, *, cfg) -> Path:
    """A checkpoint after ``done`` steps (collective): every part's state; RNG per rank. A checkpoint of another
    lineage under the same name is never replaced: ConfigError (:func:`refuse_foreign_checkpoints`)."""
    refuse_foreign_checkpoints(run_dir, [done])
    extra = {
        "step": done,
        "data_position": done * rows_per_step(cfg)[0],  # prompt groups (demonstrations) consumed
        "state_layout": STATE_LAYOUT,
        "states": {name: part.state_dict() for name, part in parts.states.items()},
    }
    return save_checkpoint(run_dir, done, models=parts.models, optimizers=parts.optimizers,
                           schedulers=parts.schedulers, extra=extra, keep=cfg.checkpoint.keep, run_id=run_id(run_dir))


def save_if_due(parts: Callable[[], Checkpointed], run_dir: Path, done: int, *, cfg, num_steps: int,
                stopping: bool) -> bool:
    """After ``done`` steps (collective): a periodic checkpoint when ``checkpoint.every`` says so, or, on a stop
    request (``stopping``, agreed by the ranks), a checkpoint and the line saying how to resume. Returns whether the
    run stops here."""
    every = cfg.checkpoint.every
    if stopping or (every > 0 and done % every == 0 and done < num_steps):
        path = save(parts(), run_dir, done, cfg=cfg)
    if stopping:
        where = f"trainer.run_dir={run_dir}" if cfg.trainer.run_dir is not None else f"trainer.run_name={run_dir.name}"
        log(f"interrupted: saved checkpoint {path.name} in {path.parent}; resume with {where} trainer.resume=auto")
    return stopping


def resume(parts: Callable[[], Checkpointed], run_dir: Path, *, cfg, num_steps: int,
           prepare: Callable[[list[str]], None]) -> int:
    """With ``trainer.resume=auto``, restore the newest intact checkpoint of the run's lineage (a damaged newer one is
    skipped with a warning); return the steps done. ``prepare`` gets the checkpoint's model names first (a part built
    lazily builds itself); ``parts`` then lists what to restore."""
    if cfg.trainer.resume != "auto":
        return 0
    path, damaged = intact_checkpoint(run_dir, run_id(run_dir))
    if path is None:
        refuse_losing_history(run_dir, damaged)
        log(f"trainer.resume=auto: no complete checkpoint in {run_dir}; starting fresh")
        refuse_foreign_checkpoints(run_dir, planned_saves(cfg, 0, num_steps))
        return 0
    warn_damaged(damaged)
    start = int(checkpoint_info(path)["step"])
    refuse_foreign_checkpoints(run_dir, planned_saves(cfg, start, num_steps))
    prepare(checkpoint_info(path)["models"])
    checkpointed = parts()
    try:
        extra = load_checkpoint(path, models=checkpointed.models, optimizers=checkpointed.optimizers,
                                schedulers=checkpointed.schedulers)
    except CheckpointMismatch as err:
        raise ConfigError(f"{err}: a resume cannot change the shape of what trains (trainer.allow_config_change "
                          f"accepts the change, not a conversion); resume with the run's model settings, or start a "
                          f"new run from its export (docs/checkpoint-trust.md)") from None
    per_step, key = rows_per_step(cfg)
    if extra["data_position"] != extra["step"] * per_step:
        raise ConfigError(
            f"{path} consumed {extra['data_position']} rows in {extra['step']} steps, which "
            f"{key}={per_step} does not give: resume with the run's own {key}")
    if extra["step"] > num_steps:
        given = (f"trainer.steps={cfg.trainer.steps}" if cfg.trainer.steps is not None
                 else f"trainer.epochs={cfg.trainer.epochs} ({num_steps} steps)")
        raise ConfigError(f"{path} is after step {extra['step']} but {given}: raise trainer.steps (or "
                          f"trainer.epochs) to continue this run")
    states = saved_states(extra, path, checkpointed.states)
    for name, part in checkpointed.states.items():
        if name in states:  # a part the checkpoint's run did not have starts fresh
            try:
                part.load_state_dict(states[name])
            except ConfigError as err:
                raise ConfigError(f"{path}: {err}") from None
    if world.rank() == 0:
        record_config_change(cfg, run_dir)
    log(f"resumed from {path} after step {extra['step']}")
    return int(extra["step"])


def refuse_losing_history(run_dir: Path, damaged: list[tuple[Path, str]]) -> None:
    """``trainer.resume=auto`` found no intact checkpoint of the run: starting fresh would rewrite the run's logged
    steps (metrics.jsonl) and later replace its damaged checkpoints. ConfigError, nothing changed, when the run has
    damaged checkpoints or logged steps; deleting them is for ``trainer.overwrite=true`` (docs/checkpoint-trust.md)."""
    if damaged:
        (newest, problem), more = damaged[0], len(damaged) - 1
        others = f" (and {more} older one{'s' if more > 1 else ''}, damaged too)" if more else ""
        raise ConfigError(f"trainer.resume=auto: every checkpoint of {run_dir} is damaged: {newest.name}: {problem}"
                          f"{others}; nothing was changed: restore the checkpoint files, or start over with "
                          f"trainer.overwrite=true (deletes the run's checkpoints and metrics) or another "
                          f"trainer.run_name")
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text(errors="replace").splitlines() if metrics.is_file() else []
    logged = sum(1 for line in lines if line.strip())
    if logged:
        raise ConfigError(f"trainer.resume=auto: {run_dir} holds {logged} logged step(s) in metrics.jsonl but no "
                          f"checkpoint to continue them from; nothing was changed: start over with "
                          f"trainer.overwrite=true (deletes them) or choose another trainer.run_name")


def planned_saves(cfg, start: int, num_steps: int) -> list[int]:
    """The steps after which a run from ``start`` to ``num_steps`` saves (``checkpoint.every``, and the last step);
    a stop signal may add one more."""
    every = cfg.checkpoint.every
    if every <= 0 or start >= num_steps:
        return []
    return [done for done in range(start + 1, num_steps + 1) if done % every == 0 or done == num_steps]


def refuse_foreign_checkpoints(run_dir: Path, steps: list[int]) -> None:
    """ConfigError when a checkpoint of another lineage holds the name of a step this run saves: a save never
    replaces another run's checkpoint (docs/checkpointing.md, Rotation)."""
    own = run_id(run_dir)
    for step in steps:
        foreign = foreign_checkpoint(run_dir, step, own)
        if foreign is not None:
            raise ConfigError(f"{foreign} belongs to another run (run id {lineage_of(foreign)}, this run's is {own}) "
                              f"and this run saves step {step} under that name; nothing was changed: move that "
                              f"checkpoint out of {foreign.parent}, or choose another trainer.run_name")


def saved_states(extra: dict, path: Path, parts: dict[str, Stateful]) -> dict[str, dict]:
    """The checkpoint's states by name, from either layout; a layout this version does not know is refused."""
    layout = extra.get("state_layout", 1)
    if layout == STATE_LAYOUT:
        return extra["states"]
    if layout == 1:
        return states_of_layout_1(extra, parts)
    raise ConfigError(f"{path} holds trainer state of layout {layout}, which this fsdptrain version (layout "
                      f"{STATE_LAYOUT}) cannot read: resume it with the fsdptrain version that wrote it")


def guard_of_layout_1(pair) -> Optional[dict]:
    """A NonFiniteGuard's state from layout 1's ``[num_skipped, num_in_a_row]`` pair."""
    return None if pair is None else {"num_skipped": int(pair[0]), "num_in_a_row": int(pair[1])}


def states_of_layout_1(extra: dict, parts: dict[str, Stateful]) -> dict[str, dict]:
    """A layout-1 checkpoint's counters as states: the guards' ``nonfinite`` pairs, the watches' counts, the prompt
    order and the reward models' moments; a part that kept other keys in ``extra`` converts them itself
    (``state_of_layout_1(extra)``)."""
    watches = extra["grad_norm_watch"]
    states = {"policy_guard": guard_of_layout_1(extra["nonfinite"]["policy"]),
              "critic_guard": guard_of_layout_1(extra["nonfinite"]["critic"]),
              "policy_watch": {"in_a_row": int(watches[0])}, "critic_watch": {"in_a_row": int(watches[1])},
              "source": ({"prompt_order": extra["prompt_order"],
                          "reward_model_moments": extra.get("reward_model_moments", [])}
                         if "prompt_order" in extra else {})}
    for name, part in parts.items():
        if hasattr(part, "state_of_layout_1"):
            states[name] = part.state_of_layout_1(extra)
    return states


def keep_metrics_before(path: Path, step: int) -> None:
    """Drop logged steps at or after ``step`` (they are about to be redone after a resume), and a partial last line
    left by a crash. The trimmed file is written beside the old one and renamed over it: a kill at any moment leaves
    the old file or the new one."""
    if path.exists():
        rows = [row for row in read_jsonl_dropping_partial_tail(path) if row["step"] < step]
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def export_hf_models(run_dir: Path, *, policy, critic, tokenizer, base_path: Optional[str] = None) -> None:
    """The final policy (and critic) as Hugging Face folders with safetensors and the tokenizer (collective).

    A policy with LoRA adapters (docs/lora.md) is written merged to ``export/policy`` and as a peft adapter to
    ``export/policy_adapter``, whose base is ``base_path`` (``model.path``) or, for a config-built model,
    ``export/policy_base``; a critic with adapters is written merged."""
    export = run_dir / "export"
    if has_adapters(policy):
        export_lora(policy, export / "policy", adapter_dir=export / "policy_adapter",
                    base_dir=export / "policy_base" if base_path is None else None, base_path=base_path,
                    tokenizer=tokenizer)
    else:
        export_hf(policy, export / "policy", tokenizer=tokenizer)
    if critic is not None and has_adapters(critic):
        export_lora(critic, export / "critic", adapter_dir=None, base_dir=None, base_path=base_path,
                    tokenizer=tokenizer)
    elif critic is not None:
        export_hf(critic, export / "critic", tokenizer=tokenizer)
