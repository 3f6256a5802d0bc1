"""Training checkpoints: atomic DCP folders, rotation, and resume at the same or another world size.

A checkpoint is the folder `run_dir/checkpoints/step_{step:08d}`:

    .metadata, __*_*.distcp   torch.distributed.checkpoint (DCP): every model's and optimizer's sharded state, keyed
                              "models/<name>/..." and "optimizers/<name>/..." (get_state_dict names, so DCP reshards
                              them to any world size on load)
    trainer_state.pt          rank 0: the schedulers' state dicts and `extra` (step, data position, counters, ...)
    rng_rank{r}.pt            rank r: its own RNG states (torch CPU, CUDA when present, python `random`)
    complete.json             rank 0, written last: {"format", "step", "world_size", "models", "optimizers", ...,
                              "files": {name: {"size", "sha256"}} of every other file in the folder}

Atomicity: everything is written into the sibling `.tmp_step_{step:08d}`; after a barrier (every rank has finished
writing) rank 0 writes `complete.json` and renames the folder into place (a directory rename is atomic on POSIX).
A crash at any moment therefore leaves either the old set of checkpoints or the old set plus a complete new one,
never a partial folder under a `step_*` name. `latest_checkpoint` also requires the marker, as a second guard.
Temp folders left by a crashed save are deleted by rank 0 at the next save or load.

RNG at another world size: rank r restores `rng_rank{r}.pt` when the checkpoint has it; a rank beyond the saved
world size seeds torch (CPU and CUDA) and python `random` with `derived_rng_seed(rank-0 torch state, r)` (the first
8 bytes of sha256(rank 0's saved torch CPU RNG state bytes + b"rank<r>"), masked to 63 bits): deterministic for a
given checkpoint and different per rank.

Trust: DCP's `.metadata` is a pickle. fsdptrain first reads it with `read_dcp_metadata`, an unpickler that builds
only DCP's metadata classes (`METADATA_GLOBALS`), so a planted `.metadata` that would run code is a damaged checkpoint
(resume falls back past it) and `load_checkpoint` refuses it before DCP unpickles it. `trainer_state.pt` and
`rng_rank*.pt` are read with `torch.load(weights_only=True)`, which is why `extra` must be plain data (see
`save_checkpoint`). Hugging Face exports (fsdptrain.distributed.export) are safetensors.

Integrity: a complete checkpoint (marker present) can still be damaged afterwards (a file deleted, truncated or
overwritten by hand, a disk error). The marker records the size and sha256 of every file rank 0 sees in the folder
when it is written (each rank's files are on disk by then: a barrier). Before resume trusts the newest one,
`checkpoint_problem` checks each recorded file's size and digest, reads the marker, DCP's metadata (restricted, as
above; it names every data file with the offset and length of each item) and the trainer state, and says what is
wrong without loading any tensor; `newest_intact_checkpoint` falls back past a damaged one with a warning.
Checkpoints written before the marker held "files" are checked without digests.

Not saved: numpy's global RNG and any generator object the caller owns (pass its state in `extra` as a tensor).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fsdptrain.distributed import world
from fsdptrain.storage.atomic import fsync_dir
from fsdptrain.model.loading import clean_name

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
MARKER = "complete.json"
TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_"
_PLAIN_SCALARS = (str, int, float, bool, type(None))


# ---------------------------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------------------------


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """The final folder of the checkpoint at `step`: run_dir/checkpoints/step_{step:08d}."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}"


def _tmp_dir(final: Path) -> Path:
    return final.with_name(_TMP_PREFIX + final.name)


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
    stale = sorted(p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX))
    if not dry_run:
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
    return stale


# ---------------------------------------------------------------------------------------------------------------
# Distributed helpers (a run without a process group is a world of one)
# ---------------------------------------------------------------------------------------------------------------


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _write_durably(path: Path, write) -> None:
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


# ---------------------------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------------------------


def _check_names(models: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]) -> None:
    for mapping, what in ((models, "model"), (optimizers, "optimizer")):
        for name in mapping:
            if not isinstance(name, str) or not name or "/" in name or "." in name:
                raise ValueError(f"{what} names must be non-empty strings without '/' or '.', got {name!r}")
    unpaired = sorted(set(optimizers) - set(models))
    if unpaired:
        raise ValueError(
            f"optimizers {unpaired} have no model of the same name: key each optimizer by the name of the model "
            f"whose parameters it updates (models={sorted(models)})"
        )


def _frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of the frozen parameters, tied aliases included (``lm_head.weight`` of a tied
    embedding: DCP's ``ignore_frozen_params`` drops the parameter's first name only)."""
    return {clean_name(name) for name, param in model.named_parameters(remove_duplicate=False)
            if not param.requires_grad}


def _state_options(model: nn.Module) -> StateDictOptions:
    """Frozen parameters (the base weights under LoRA) are not checkpointed: they never change and are rebuilt from
    the model's source. Loading then leaves them as built (strict only when every parameter trains)."""
    return StateDictOptions(ignore_frozen_params=True, strict=not _frozen_names(model))


def _sharded_state(models: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]) -> dict[str, Any]:
    """{"models": {name: model state}, "optimizers": {name: optimizer state}} with FQN keys and DTensor shards;
    trainable parameters and buffers only (`_state_options`)."""
    state: dict[str, Any] = {"models": {}, "optimizers": {}}
    for name, model in models.items():
        options = _state_options(model)
        if name in optimizers:
            state["models"][name], state["optimizers"][name] = get_state_dict(model, optimizers[name],
                                                                               options=options)
        else:
            state["models"][name] = get_model_state_dict(model, options=options)
        for frozen in _frozen_names(model):
            state["models"][name].pop(frozen, None)
    return state


def _check_plain(value: Any, where: str) -> None:
    """`extra` must round-trip through torch.load(weights_only=True): plain containers, scalars and tensors."""
    if isinstance(value, _PLAIN_SCALARS) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, _PLAIN_SCALARS):
                raise ValueError(f"extra{where} has a key of type {type(key).__name__}; use str or int keys")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise ValueError(
        f"extra{where} is a {type(value).__name__}: checkpoint extras must be plain data (dict, list, tuple, str, "
        f"int, float, bool, None, torch.Tensor) so that they load without unpickling code; convert it first"
    )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def derived_rng_seed(rank0_torch_state: torch.Tensor, rank: int) -> int:
    """The seed of a rank that has no saved RNG state (resume at a larger world size): the first 8 bytes of
    sha256(rank 0's saved torch CPU RNG state + b"rank<rank>"), little-endian, masked to 63 bits."""
    digest = hashlib.sha256(rank0_torch_state.numpy().tobytes() + f"rank{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _restore_rng(path: Path, rank: int) -> None:
    own = path / f"rng_rank{rank}.pt"
    if own.is_file():
        state = torch.load(own, weights_only=True)
        torch.set_rng_state(state["torch"])
        random.setstate(_as_python_random_state(state["python"]))
        if "cuda" in state and torch.cuda.is_available():
            cuda_states = state["cuda"]
            # A resume on fewer or other devices: restore what lines up, by device index.
            for index in range(min(len(cuda_states), torch.cuda.device_count())):
                torch.cuda.set_rng_state(cuda_states[index], index)
        return
    rank0 = torch.load(path / "rng_rank0.pt", weights_only=True)
    seed = derived_rng_seed(rank0["torch"], rank)
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)


def _as_python_random_state(state: Any) -> tuple:
    # random.setstate wants tuples all the way down; a round trip may hand back lists.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


# ---------------------------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------------------------


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, Optimizer],
    schedulers: Mapping[str, LRScheduler],
    extra: Mapping[str, Any],
    keep: int | None = None,
    run_id: str | None = None,
) -> Path:
    """Save a checkpoint of `step` atomically; return its final folder. Collective: every rank calls it.

    models: name -> model (FSDP2-sharded or plain); optimizers: name -> the optimizer of the model with the same
    name (a model may have none, e.g. a frozen reference); schedulers: name -> LR scheduler (state saved by rank 0,
    identical on every rank). extra: plain data (dict/list/tuple/str/int/float/bool/None/tensor) such as the step,
    the data position and the non-finite counters; rank 0's copy is saved and every rank gets it back from
    `load_checkpoint`. The RNG states of every rank are captured here; the caller need not pass them.
    keep: if given, rank 0 then deletes all but the newest `keep` complete checkpoints (and stale temp folders).
    run_id: the run's lineage, written into the marker; rotation then counts and deletes only that lineage's.
    An existing checkpoint of the same step is replaced when it is of the same lineage; one of another lineage (or
    of none, when ``run_id`` is given) is never touched: the save raises ValueError before writing anything.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    foreign = foreign_checkpoint(run_dir, step, run_id)
    if foreign is not None:
        raise ValueError(f"{foreign} is a checkpoint of another run (lineage {lineage_of(foreign)}, not {run_id}): "
                         f"a save never replaces it")
    _check_names(models, optimizers)
    _check_plain(dict(extra), "")
    rank, world_size = world.rank(), world.world_size()
    final = checkpoint_dir(run_dir, step)
    tmp = _tmp_dir(final)
    if rank == 0:
        remove_stale_temp_dirs(run_dir)
        tmp.mkdir(parents=True)
    _barrier()

    dcp.save(_sharded_state(models, optimizers), checkpoint_id=tmp)
    _write_durably(tmp / f"rng_rank{rank}.pt", lambda f: torch.save(_rng_state(), f))
    if rank == 0:
        trainer_state = {
            "schedulers": {name: sched.state_dict() for name, sched in schedulers.items()},
            "extra": dict(extra),
        }
        _write_durably(tmp / TRAINER_STATE, lambda f: torch.save(trainer_state, f))
    _barrier()  # every rank's files are on disk before the marker says so

    if rank == 0:
        marker = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "models": sorted(models),
            "optimizers": sorted(optimizers),
            "schedulers": sorted(schedulers),
            "run_id": run_id,
            "files": file_digests(tmp),
        }
        _write_durably(tmp / MARKER, lambda f: f.write(json.dumps(marker, indent=1).encode()))
        _rename_into_place(tmp, final)
        if keep is not None:
            prune_checkpoints(run_dir, keep, run_id)
    _barrier()  # no rank returns (or exits on SIGTERM) before the checkpoint is in place
    return final


def _rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        # A directory rename cannot replace a non-empty directory: move the old one aside first (a crash between
        # the two renames loses this step's checkpoint, never an older one; the aside folder is a temp folder).
        aside = final.with_name(f"{_TMP_PREFIX}old_{final.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, Optimizer],
    schedulers: Mapping[str, LRScheduler],
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore models, optimizers, schedulers and (by default) this rank's RNG states in place from the complete
    checkpoint at `path`; return the saved `extra`. Collective: every rank calls it.

    The models and optimizers must be built exactly as for the save (same architecture, same names); the world size
    may differ (DCP reshards the DTensor shards; RNG as in the module docstring). Other parts, or models whose
    tensors differ in name or shape from the checkpoint's metadata, raise :class:`CheckpointMismatch` before any
    tensor is read. Rank 0 first deletes stale temp folders of the run. Only load checkpoints you trust: DCP metadata
    is a pickle.
    """
    path = Path(path)
    info = checkpoint_info(path)
    _check_names(models, optimizers)
    try:
        metadata = read_dcp_metadata(path)  # DCP unpickles .metadata without restriction: refuse code first
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"checkpoint {path}: .metadata is not checkpoint metadata ({err})") from None
    for kind, given in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers)):
        if sorted(given) != info[kind]:
            raise CheckpointMismatch(f"checkpoint {path} holds {kind} {info[kind]} but this run builds "
                                     f"{sorted(given)}")
    state = _sharded_state(models, optimizers)
    mismatch = shape_mismatch(saved_shapes(metadata), state["models"])
    if mismatch is not None:  # before DCP reads a byte: it would fail deep inside with a long traceback
        raise CheckpointMismatch(f"checkpoint {path} does not fit the models this run builds: {mismatch}")
    if world.rank() == 0:
        remove_stale_temp_dirs(path.parent.parent)

    dcp.load(state, checkpoint_id=path)
    for name, model in models.items():
        if name in optimizers:
            set_state_dict(
                model,
                optimizers[name],
                model_state_dict=state["models"][name],
                optim_state_dict=state["optimizers"][name],
                options=_state_options(model),
            )
        else:
            set_model_state_dict(model, state["models"][name], options=_state_options(model))

    trainer_state = torch.load(path / TRAINER_STATE, weights_only=True)
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(trainer_state["schedulers"][name])
    if restore_rng:
        _restore_rng(path, world.rank())
    _barrier()
    return trainer_state["extra"]


class CheckpointMismatch(ValueError):
    """The checkpoint holds other parts, names or shapes than the run builds (a resume across a change of the model's
    shape: LoRA on or off, another rank, another size): the message names the first difference."""


def saved_shapes(metadata) -> dict[str, tuple[int, ...]]:
    """``{flattened key: global shape}`` of every tensor DCP's metadata records (``models.<name>.<fqn>``, ...)."""
    return {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}


def shape_mismatch(saved: dict[str, tuple[int, ...]], built: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first difference between the models' tensors a checkpoint holds (``saved``, from :func:`saved_shapes`)
    and the models' state this run builds (``built``: name -> fqn -> tensor; DTensor shapes are global), as one
    phrase; None when every name and shape agrees."""
    for name, state in built.items():
        prefix = f"models.{name}."
        held = {key[len(prefix):]: shape for key, shape in saved.items() if key.startswith(prefix)}
        here = {key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}
        resized = [key for key in sorted(set(held) & set(here)) if held[key] != here[key]]
        missing, unknown = sorted(set(here) - set(held)), sorted(set(held) - set(here))
        parts = []
        if resized:
            key = resized[0]
            parts.append(f"{len(resized)} {name} tensor(s) differ in shape ({key}: {list(held[key])} in the "
                         f"checkpoint, {list(here[key])} here)")
        if missing:
            parts.append(f"{len(missing)} {name} tensor(s) this run trains are not in it ({missing[0]})")
        if unknown:
            parts.append(f"{len(unknown)} {name} tensor(s) in it are not trained here ({unknown[0]})")
        if parts:
            return "; ".join(parts)
    return None


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
