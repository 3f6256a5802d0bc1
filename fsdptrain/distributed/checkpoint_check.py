"""Is a checkpoint whole? What resume checks before it trusts the newest one (docs/checkpointing.md).

A complete checkpoint (marker present) can still be damaged afterwards: a file deleted or truncated by hand, a disk
error. :func:`checkpoint_problem` reads the marker, DCP's metadata (which names every data file with the offset and
length of each item), the trainer state and rank 0's RNG file, and says what is wrong without loading any tensor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from fsdptrain.distributed.checkpoint import MARKER, TRAINER_STATE, complete_checkpoints


def checkpoint_problem(path: Path) -> str | None:
    """A one-line description of what is damaged in the checkpoint folder ``path``, or None when it is whole."""
    try:
        json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as err:
        return f"{MARKER} is unreadable ({type(err).__name__})"
    for name in (".metadata", TRAINER_STATE, "rng_rank0.pt"):
        if not (path / name).is_file():
            return f"{name} is missing"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a pickle that does not load: any exception means damaged
        return f".metadata is unreadable ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if os.path.getsize(file) < size:
            return f"{name} is truncated ({os.path.getsize(file)} of {size} bytes)"
    try:
        torch.load(path / TRAINER_STATE, weights_only=True)
    except Exception as err:  # a truncated or corrupt torch file
        return f"{TRAINER_STATE} is unreadable ({type(err).__name__})"
    return None


def lineage_of(path: Path) -> str | None:
    try:
        return json.loads((path / MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def newest_intact_checkpoint(run_dir: Path, run_id: str | None) -> Path | None:
    """The newest complete checkpoint of the lineage ``run_id`` (or without one) that is whole; each newer damaged
    one is skipped with a warning on stderr naming what is wrong."""
    for path in reversed(complete_checkpoints(run_dir)):
        owner = lineage_of(path)
        if run_id is not None and owner is not None and owner != run_id:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"warning: skipping damaged checkpoint {path}: {problem}; falling back to an older one",
              file=sys.stderr, flush=True)
    return None
