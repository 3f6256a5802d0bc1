"""Checkpoint folders and what makes one trustworthy, apart from the sharded state inside them
(fsdptrain/distributed/sharded_checkpoint.py writes and reads that): where a step's folder is, which are complete,
rotation, the leftovers of a crashed save, and the integrity and lineage checks resume runs before it trusts the
newest one (docs/checkpoint-trust.md).

Trust: DCP's `.metadata` is a pickle. It is read here with `read_dcp_metadata`, an unpickler that builds only DCP's
metadata classes (`METADATA_GLOBALS`), so a planted `.metadata` that would run code is a damaged checkpoint (resume
falls back past it) and `load_checkpoint` refuses it before DCP unpickles it.

Integrity: a complete checkpoint (marker present) can still be damaged afterwards (a file deleted, truncated or
overwritten by hand, a disk error). The marker records the size and sha256 of every file rank 0 sees in the folder
when it is written. Before resume trusts the newest one, `checkpoint_problem` checks each recorded file's size and
digest, reads the marker, DCP's metadata (restricted, as above) and the trainer state, and says what is wrong without
loading any tensor; `newest_intact_checkpoint` falls back past a damaged one with a warning. Checkpoints written
before the marker held "files" are checked without digests. Nothing here needs a process group.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
MARKER = "complete.json"
TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp_"


# ---------------------------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------------------------


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """The final folder of the checkpoint at `step`: run_dir/checkpoints/step_{step:08d}."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}"


def tmp_dir(final: Path) -> Path:
    return final.with_name(TMP_PREFIX + final.name)


def is_complete(path: str | os.PathLike) -> bool:
    """True when `path` is a `step_*` folder holding the completion marker (written last, before the rename)."""
    path = Path(path)
    return _STEP_DIR.match(path.name) is not None and (path / MARKER).is_file()


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every complete checkpoint of the run, oldest step first. Temp and unmarked folders are ignored."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of the run (marker present), or None when there is none."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_info(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of a checkpoint: step, world_size, the names of its models, optimizers, schedulers."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise ValueError(
            f"{path} is not a complete checkpoint (no {MARKER}): it may be a save that crashed; "
            f"resume from latest_checkpoint(run_dir) instead"
        )
    return json.loads(marker.read_text())


def prune_checkpoints(run_dir: str | os.PathLike, keep: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and every stale temp folder; return what was deleted.

    With `run_id`, only checkpoints whose marker carries that run id count and may be deleted: another lineage's
    checkpoints in the same folder are left alone. Not collective: call it on one rank (save_checkpoint calls it on
    rank 0 after the rename).
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    complete = [p for p in complete_checkpoints(run_dir) if run_id is None or lineage_of(p) == run_id]
    doomed = complete[:-keep] + remove_stale_temp_dirs(run_dir, dry_run=True)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_stale_temp_dirs(run_dir: str | os.PathLike, *, dry_run: bool = False) -> list[Path]:
    """Delete the `.tmp_*` folders under run_dir/checkpoints (left by a save that crashed); return them.

    Only safe while no save is in progress for this run (one run writes a run directory at a time).
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX))
    if not dry_run:
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
    return stale


# Integrity: is a checkpoint whole? What resume checks before it trusts the newest one.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = {
    _DCP_METADATA: {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}
"""What a DCP ``.metadata`` pickle may name (besides torch's dtypes): DCP's metadata classes and the plain values they
hold. Each only builds data; none runs a command or opens a file."""
DIGEST_CHUNK = 1 << 20


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not a checkpoint metadata class")


def read_dcp_metadata(path: Path):
    """DCP's ``Metadata`` of the checkpoint folder ``path``, unpickled with only ``METADATA_GLOBALS``; raises
    pickle.UnpicklingError for a file that names anything else (code), other errors for a damaged file."""
    with open(Path(path) / ".metadata", "rb") as handle:
        metadata = _MetadataUnpickler(io.BytesIO(handle.read())).load()
    if type(metadata).__name__ != "Metadata" or type(metadata).__module__ != _DCP_METADATA:
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` of every file in ``folder`` but the marker (what the marker records)."""
    found = {}
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name != MARKER:
            digest = hashlib.sha256()
            with open(file, "rb") as handle:
                while chunk := handle.read(DIGEST_CHUNK):
                    digest.update(chunk)
            found[file.name] = {"size": file.stat().st_size, "sha256": digest.hexdigest()}
    return found


def _recorded_file_problem(path: Path, recorded: dict[str, dict[str, Any]]) -> str | None:
    """What differs between the files the marker recorded and the folder now (None when every one is as saved)."""
    for name, want in sorted(recorded.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["size"]:
            return (f"{name} is truncated ({size} of {want['size']} bytes)" if size < want["size"] else
                    f"{name} has {size} bytes, {want['size']} were saved")
    now = file_digests(path)
    for name, want in sorted(recorded.items()):
        if now[name]["sha256"] != want["sha256"]:
            return f"{name} changed since it was saved (sha256 differs)"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """A one-line description of what is damaged in the checkpoint folder ``path``, or None when it is whole."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as err:
        return f"{MARKER} is unreadable ({type(err).__name__})"
    if not isinstance(marker, dict):
        return f"{MARKER} is not a JSON object"
    for name in (".metadata", TRAINER_STATE, "rng_rank0.pt"):
        if not (path / name).is_file():
            return f"{name} is missing"
    if isinstance(marker.get("files"), dict):
        problem = _recorded_file_problem(path, marker["files"])
        if problem is not None:
            return problem
    try:
        metadata = read_dcp_metadata(path)
    except pickle.UnpicklingError as err:
        return f".metadata is not checkpoint metadata ({err})"
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


def intact_checkpoint(run_dir: Path, run_id: str | None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of the lineage ``run_id`` (or without one) that is whole (None when none is),
    and the newer damaged ones of that lineage with what is wrong with each, newest first."""
    damaged = []
    for path in reversed(complete_checkpoints(run_dir)):
        owner = lineage_of(path)
        if run_id is not None and owner is not None and owner != run_id:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def warn_damaged(damaged: list[tuple[Path, str]]) -> None:
    """One warning on stderr per damaged checkpoint that resume falls back past."""
    for path, problem in damaged:
        print(f"warning: skipping damaged checkpoint {path}: {problem}; falling back to an older one",
              file=sys.stderr, flush=True)


def newest_intact_checkpoint(run_dir: Path, run_id: str | None) -> Path | None:
    """:func:`intact_checkpoint`'s checkpoint; each newer damaged one is skipped with a warning on stderr."""
    path, damaged = intact_checkpoint(run_dir, run_id)
    warn_damaged(damaged)
    return path


def foreign_checkpoint(run_dir: str | os.PathLike, step: int, run_id: str | None) -> Path | None:
    """The checkpoint folder of ``step`` when it exists and belongs to another lineage than ``run_id`` (or to none):
    a save of this lineage must not replace it. None when the name is free or this lineage's (or ``run_id`` is None:
    a caller without lineages)."""
    final = checkpoint_dir(run_dir, step)
    if run_id is None or not (final.exists() or final.is_symlink()):
        return None
    return None if lineage_of(final) == run_id else final
