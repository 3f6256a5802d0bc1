"""Gathered weights for generation: all-gather an FSDP2 model's parameters once around a whole ``generate`` call.

A sharded model all-gathers each decoder layer in its pre-forward and frees it again in its post-forward. During
``generate`` that is one all-gather per layer per decoded token. :func:`gathered_weights` instead unshards every FSDP
unit once (``FSDPModule.unshard``), turns off the post-forward reshard for the block (``set_reshard_after_forward``),
and afterwards reshards every unit and restores the layers' setting. The arithmetic is unchanged (the same gathered
tensors in the same dtype), so the tokens generated are identical either way (tests/dist/test_gather.py).

The cost is memory: each rank holds the whole unsharded model for the duration. :func:`should_gather` decides the
``auto`` mode: gather when the unsharded parameters fit in ``max_share`` of the free memory on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdptrain.config.schema import GATHER_MODES
from fsdptrain.distributed import world


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 units of ``model`` (its decoder layers and the root), in module order; empty if not sharded."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unsharded_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the whole model's parameters gathered in ``dtype`` (the mixed-precision param dtype)."""
    total = 0
    for param in model.parameters():
        numel = param.numel()  # a DTensor's numel is its global size
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def free_memory_bytes(device: torch.device) -> int:
    """Free memory this rank may use: the CUDA allocator's free bytes, else the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def should_gather(model: nn.Module, *, mode: str, max_share: float, param_dtype: torch.dtype,
                  device: torch.device) -> bool:
    """Whether to gather for generation. Collective for ``auto`` (every rank must agree: unshard all-gathers).

    ``auto``: the unsharded parameters (less this rank's shard, already resident) fit in ``max_share`` of the free
    memory on every rank, and the model is sharded at all.
    """
    if mode not in GATHER_MODES:
        raise ValueError(f"rollout.gather_weights={mode!r}: choose one of {', '.join(GATHER_MODES)}")
    if mode == "never" or not fsdp_units(model):
        return False
    if mode == "always":
        return True
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    need = unsharded_bytes(model, param_dtype) if sharded else 0
    fits = float(need <= max_share * free_memory_bytes(device))
    return bool(world.all_reduce_min(torch.tensor([fits], dtype=torch.float64))[0] > 0.5)


@contextlib.contextmanager
def gathered_weights(model: nn.Module, *, enabled: bool, reshard_after_forward: bool) -> Iterator[None]:
    """Hold every FSDP unit of ``model`` unsharded for the block (collective; every rank passes the same ``enabled``).

    ``reshard_after_forward`` is the layers' configured setting, restored on exit (the root keeps its own: False).
    """
    units = fsdp_units(model)
    if not enabled or not units:
        yield
        return
    root = model if units[0] is model else None
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward and unit is not root, recurse=False)
