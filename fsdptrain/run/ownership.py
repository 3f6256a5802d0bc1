"""Who owns a run directory: one run's lineage, one writer at a time, no silent overwrite (docs/checkpoint-trust.md).

- ``run.json`` holds the run id of the directory's lineage; every checkpoint's marker carries it, and rotation
  deletes only checkpoints of that id. It is also the mark that fsdptrain claimed the folder.
- A run is written only into a missing or empty folder, or into fsdptrain's own run folder: one with ``run.json``,
  or (a run written before ``run.json`` existed) one holding nothing but what a run writes (``RUN_ENTRIES``). Any
  other folder holds the user's own files and is refused, before anything is written into it.
- A directory that holds a run is continued only with ``trainer.resume=auto``; ``trainer.overwrite=true`` clears it
  first; anything else is a usage error naming both.
- ``.lock`` is held with ``fcntl.flock`` by the process that claimed the directory (the CLI's parent, or rank 0
  under torchrun) for the run's life: the kernel releases it when that process ends, even by SIGKILL, so a stale
  lock never blocks a later run.
- A resume whose model, algorithm or loss mode differs from the saved ``config.yaml`` is refused unless
  ``trainer.allow_config_change=true``; an accepted change is appended to ``config_changes.jsonl`` once the
  checkpoint has loaded (a checkpoint that does not fit the changed model is refused with nothing written).

Torch-free: the CLI's parent runs it before any rank starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import ConfigError
from fsdptrain.storage.atomic import append_line, write_atomic

STATE_FILE = "run.json"
LOCK_FILE = ".lock"
CHANGES_FILE = "config_changes.jsonl"
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "export", "config.yaml", STATE_FILE, CHANGES_FILE, "tensorboard",
               "metrics.png", "samples.jsonl", "metric_kinds.json")
"""What a run writes into its directory: what ``trainer.overwrite=true`` deletes (nothing else)."""
TRANSIENT_PREFIXES = (LOCK_FILE, ".write_probe-")
"""Entries fsdptrain makes while it claims a folder (the lock, the writability probe): not the user's files."""
GUARDED_KEYS = ("model", "algorithm", "loss.agg_mode")
"""Config a resume may not change without ``trainer.allow_config_change=true``."""

_held_locks: list = []  # open lock files of this process: closed (released) only when the process ends


def holds_run(run_dir: Path) -> bool:
    """True when ``run_dir`` has a run's metrics, checkpoints or export in it (a ``run.json`` alone is a start that
    failed before its first step: a new launch may take the directory over)."""
    return any((run_dir / name).exists() for name in ("checkpoints", "metrics.jsonl", "export"))


def foreign_entries(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` that show it is not fsdptrain's run folder (sorted; empty when it may be claimed).

    A missing or empty folder, a folder with ``run.json``, or one that holds a run and nothing but ``RUN_ENTRIES``
    may be claimed; any other folder's entries (besides the lock and the probe) are the user's own.
    """
    if not run_dir.is_dir() or (run_dir / STATE_FILE).is_file():
        return []
    names = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(TRANSIENT_PREFIXES))
    if not names or (holds_run(run_dir) and set(names) <= set(RUN_ENTRIES)):
        return []
    return names


def refuse_foreign_folder(run_dir: Path, where: str) -> None:
    """Raise ConfigError when ``run_dir`` holds files fsdptrain did not write (``foreign_entries``)."""
    names = foreign_entries(run_dir)
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(f"{where}: {run_dir} holds files fsdptrain did not write ({shown}); a run is written only "
                          f"into a new or empty folder or its own run folder: choose another trainer.run_dir or "
                          f"trainer.run_name (docs/checkpoint-trust.md)")


def run_id(run_dir: Path) -> str | None:
    """The lineage id of the run in ``run_dir`` (None for a directory without ``run.json``)."""
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lock_run_dir(run_dir: Path) -> None:
    """Hold ``run_dir/.lock`` for the life of this process, or raise ConfigError when another process holds it."""
    handle = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise ConfigError(f"trainer.run_dir {run_dir} is in use by another fsdptrain run (pid {owner}): wait for it "
                          f"to end, or choose another trainer.run_name") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _held_locks.append(handle)


def claim_run_dir(cfg: DictConfig, run_dir: Path, where: str) -> str:
    """Decide whether this launch may write ``run_dir`` (lock held); return the lineage's run id.

    ``where`` is how the user named the directory (``trainer.run_name=x``), for the message.
    """
    refuse_foreign_folder(run_dir, where)
    trainer = cfg.trainer
    if holds_run(run_dir):
        if trainer.overwrite:
            clear_run(run_dir)
        elif trainer.resume == "auto":
            check_config_change(cfg, run_dir)
            existing = run_id(run_dir) or _newest_marker_run_id(run_dir)
            if existing is not None:
                if run_id(run_dir) is None:  # checkpoints copied in, or written before run.json existed: adopt them
                    write_atomic(run_dir / STATE_FILE, json.dumps({"run_id": existing, "created": time.time()}) + "\n")
                return existing
        else:
            raise ConfigError(f"{run_dir} already holds a run: continue it with {where} trainer.resume=auto, start "
                              f"over with trainer.overwrite=true, or choose another trainer.run_name")
    new_id = uuid.uuid4().hex
    write_atomic(run_dir / STATE_FILE, json.dumps({"run_id": new_id, "created": time.time()}) + "\n")
    return new_id


def _newest_marker_run_id(run_dir: Path) -> str | None:
    """The run id in the marker of the newest checkpoint folder that has one (torch-free: JSON only)."""
    for folder in sorted((run_dir / "checkpoints").glob("step_*"), reverse=True):
        try:
            found = json.loads((folder / "complete.json").read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            return found
    return None


def clear_run(run_dir: Path) -> None:
    """Delete what a run wrote (``RUN_ENTRIES``); other files in the directory are left alone."""
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _flat(cfg: DictConfig, key: str) -> dict[str, object]:
    node = OmegaConf.select(cfg, key)
    if isinstance(node, DictConfig):
        return {f"{key}.{k}": v for k, v in OmegaConf.to_container(node).items()}
    return {key: node}


def config_changes(old: DictConfig, new: DictConfig) -> dict[str, list]:
    """``{dotted key: [old, new]}`` for every guarded key that differs."""
    changes = {}
    for key in GUARDED_KEYS:
        before, after = _flat(old, key), _flat(new, key)
        for name in sorted(set(before) | set(after)):
            if before.get(name) != after.get(name):
                changes[name] = [before.get(name), after.get(name)]
    return changes


def _saved_config_changes(cfg: DictConfig, run_dir: Path) -> dict[str, list]:
    """:func:`config_changes` between the run's saved ``config.yaml`` (none: no change) and ``cfg``."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return {}
    try:
        old = OmegaConf.load(saved)
    except Exception as err:  # a damaged config.yaml: the user's to look at
        raise ConfigError(f"{saved} cannot be read ({str(err).splitlines()[0]}): fix or remove it to resume") from None
    return config_changes(old, cfg)


def check_config_change(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse a resume whose model, algorithm or loss mode differs from the saved run's, unless allowed (the change
    is recorded by :func:`record_config_change` once the checkpoint has loaded: a refused resume writes nothing)."""
    changes = _saved_config_changes(cfg, run_dir)
    if changes and not cfg.trainer.allow_config_change:
        listed = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changes.items())
        raise ConfigError(f"resuming {run_dir} with a different config ({listed}): keep the run's values, or set "
                          f"trainer.allow_config_change=true to resume anyway")


def record_config_change(cfg: DictConfig, run_dir: Path) -> None:
    """Append an accepted change of the guarded config to ``config_changes.jsonl`` (main rank, after the resume)."""
    changes = _saved_config_changes(cfg, run_dir)
    if changes:
        append_line(run_dir / CHANGES_FILE, json.dumps({"time": time.time(), "changes": changes}))
