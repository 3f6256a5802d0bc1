"""One run flow for every recipe (``fsdptrain train``'s RL recipe, ``fsdptrain sft``'s), written once.

:func:`run_recipe` is a recipe's job on one rank: the process group and the mesh, the seeds, the recipe built by the
caller's function, then :func:`run_steps`: resume, the run directory's ``config.yaml`` and trimmed logs, the start
report, the trackers, the progress bar, each step's metrics line, ``save_if_due``, the final checkpoint and the
export, the summary. The recipe comes in through :class:`Recipe` only, so this module imports no recipe
(fsdptrain/train/rl.py, fsdptrain/train/sft.py), no rollout source and no check.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import validate_world
from fsdptrain.config import DEFAULT_STEPS
from fsdptrain.distributed import world
from fsdptrain.storage.atomic import write_atomic
from fsdptrain.run.checkpointer import Checkpointed, keep_metrics_before, resume, save, save_if_due
from fsdptrain.run.console import log, progress_columns, quiet_known_warnings, stats_line
from fsdptrain.run.outputs import MetricsFiles
from fsdptrain.run.signals import StopRequest
from fsdptrain.run.trackers import Trackers


class Recipe(Protocol):
    """What the run flow asks of a recipe. Every method is called on every rank in the same order (it may be
    collective); the recipe prints or writes on rank 0 only where it says so."""

    name: str
    """The progress bar's label (``train``, ``sft``)."""
    stats: Sequence[tuple[str, str, str]]
    """The progress bar's fields: (metric, label, format spec), shown when the step's result holds the metric."""
    cfg: DictConfig
    info: world.DistInfo
    run_dir: Path
    num_steps: int
    kinds: dict[str, str]
    """The kind of every metric logged so far (``Kind`` values), for ``metric_kinds.json``."""

    def checkpointed(self) -> Checkpointed:
        """Every stateful part of the run, by name, for the checkpointer (docs/checkpointing.md)."""

    def prepare_to_load(self, saved_models: list[str]) -> None:
        """Build what a checkpoint holding ``saved_models`` will load into."""

    def report_start(self) -> None:
        """Print what the run is about to do (rank 0)."""

    def begin(self, start: int) -> None:
        """Before the first step this run takes (``start``: the steps already done by a resumed run)."""

    def run_step(self, step: int) -> dict[str, float]:
        """One step; the finalised metrics, the same on every rank."""

    def after_step(self, step: int, result: dict[str, float], *, first: bool, console) -> None:
        """After the step's metrics line is written: the recipe's own records of it (``first``: the run's first step;
        ``console``: the progress bar's console on rank 0 with progress shown, else None)."""

    def export(self, run_dir: Path) -> None:
        """The final models under ``run_dir/export`` (collective)."""

    def summarize(self, history: list[dict[str, float]]) -> None:
        """The end-of-run summary of the steps this run took (rank 0 prints)."""

    def close(self) -> None:
        """Release what the recipe holds (worker processes); called on every way out."""


BuildRecipe = Callable[[DictConfig, Path, world.DistInfo, object], Recipe]


def resolve_steps(cfg: DictConfig, num_rows: Optional[int], *, rows_per_step: int) -> int:
    """The run's step count: ``trainer.steps``, else ``ceil(trainer.epochs x num_rows / rows_per_step)`` (the
    recipe's rows per step: RL's prompts, SFT's demonstrations), else the default."""
    if cfg.trainer.steps is not None:
        return int(cfg.trainer.steps)
    if cfg.trainer.epochs is None:
        return DEFAULT_STEPS
    # The small tolerance keeps e.g. 0.3 x 100 rows / 10 at 3 steps despite 0.3 x 100 = 30.000000000000004.
    return max(1, math.ceil(cfg.trainer.epochs * num_rows / rows_per_step - 1e-9))


def run_recipe(cfg: DictConfig, run_dir: str, build: BuildRecipe, *, device_type: str) -> int:
    """A recipe's job on this rank: the process group and mesh, the seeds, ``build(cfg, run_path, info, mesh)``,
    then :func:`run_steps`; returns the exit code."""
    quiet_known_warnings()
    stop = StopRequest()
    stop.install()
    info = world.init_distributed(device_type=device_type)
    replicate, shard = validate_world(cfg, info.world_size)
    mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type=info.device.type, cp=cfg.parallel.cp)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    run_path = Path(run_dir).absolute()  # fixed now: the user's code may change the working directory later
    recipe = build(cfg, run_path, info, mesh)
    try:  # worker processes and the trackers end on every way out (errors, Ctrl-C, SIGTERM)
        code = run_steps(recipe, stop)
    finally:
        recipe.close()
    world.destroy_distributed()
    return code


def run_steps(recipe: Recipe, stop: StopRequest) -> int:
    """Resume, then the steps from the resumed one to ``recipe.num_steps`` with their metrics lines and checkpoints,
    then the final checkpoint, the export and the summary; returns the exit code (0, also when a stop request ends
    the run at a step boundary after its checkpoint)."""
    cfg, info, run_path, num_steps = recipe.cfg, recipe.info, recipe.run_dir, recipe.num_steps
    start = resume(recipe.checkpointed, run_path, cfg=cfg, num_steps=num_steps, prepare=recipe.prepare_to_load)
    files = MetricsFiles(run_path, resumed=start > 0)
    if info.is_main:
        run_path.mkdir(parents=True, exist_ok=True)
        write_atomic(run_path / "config.yaml", OmegaConf.to_yaml(cfg))
        for logged in ("metrics.jsonl", "samples.jsonl"):
            keep_metrics_before(run_path / logged, start)
    recipe.report_start()
    recipe.begin(start)
    history = []
    trackers = Trackers(cfg, run_path, is_main=info.is_main)
    show = info.is_main and cfg.logging.progress
    from rich.progress import Progress

    try:
        with Progress(*progress_columns(), disable=not show, transient=False) as progress:
            task = progress.add_task(recipe.name, total=num_steps, completed=start, stats="")
            for step in range(start, num_steps):
                result = recipe.run_step(step)
                history.append(result)
                if info.is_main:
                    files.write(result, recipe.kinds)
                    trackers.log(result)
                recipe.after_step(step, result, first=step == start, console=progress.console if show else None)
                progress.update(task, advance=1, stats=stats_line(result, recipe.stats))
                if save_if_due(recipe.checkpointed, run_path, step + 1, cfg=cfg, num_steps=num_steps,
                               stopping=world.any_flag(stop.requested)):
                    return 0
    finally:
        trackers.close()
    if cfg.checkpoint.every > 0 and start < num_steps:  # else the resumed checkpoint is this one
        save(recipe.checkpointed(), run_path, num_steps, cfg=cfg)
    recipe.export(run_path)
    if history:
        recipe.summarize(history)
    log(f"run directory: {run_path} (metrics.jsonl, export/)")
    return 0
