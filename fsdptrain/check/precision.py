"""check-metrics' precision: ``check.dtype=float64`` (the default) or ``model``, and the tolerances that go with it.

In float64 mode every checked model (policy, critic, reference, teacher, drafter) is built with float64 master
weights and FSDP2 gathers and reduces in float64 (``parallel.param_dtype`` and ``reduce_dtype`` of the checked
config), and the whole check after the build runs under :class:`Float64Mode`: a request for float32 (``.float()``,
``.to(torch.float32)``, ``dtype=torch.float32`` of a factory or a softmax) gives float64, and the default dtype is
float64. So HF Llama's RMSNorm (which computes its variance after ``.to(torch.float32)``), the rotary embedding's
``.float()``, the packed loss's float32 buffers, the experience's stored targets and the metrics all stay in float64,
without a change to the product's code. Rounding then sits near 1e-13 relative, far below any bug, and one tight
tolerance serves every model (docs/check-metrics.md, "Precision").

``model`` runs the check in the configured ``parallel.param_dtype`` (float32 or bf16) with looser tolerances: the
only way to check a kernel that has no float64 path (flash-attn), which float64 mode swaps for the exact fallback.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from omegaconf import DictConfig
from torch.overrides import TorchFunctionMode

from fsdptrain.model.attention_switch import available_backends

FLOAT64 = "float64"
TOLERANCES = {"float64": (1.0e-9, 1.0e-10), "model": (1.0e-5, 1.0e-6)}
"""check.dtype -> the default (rtol, atol). float64: measured rounding is near 1e-13 relative (docs/check-metrics.md);
model: fp32 layouts agree to about 1e-7 relative on small models."""


def tolerances(cfg: DictConfig) -> tuple[float, float]:
    """``(rtol, atol)``: ``check.rtol`` and ``check.atol`` as set, else the defaults of ``check.dtype``."""
    rtol, atol = TOLERANCES[cfg.check.dtype]
    return (rtol if cfg.check.rtol is None else float(cfg.check.rtol),
            atol if cfg.check.atol is None else float(cfg.check.atol))


def _promoted(value):
    return torch.float64 if value is torch.float32 else value


class Float64Mode(TorchFunctionMode):
    """Every float32 request becomes float64: ``Tensor.float()``, and any positional or keyword argument that is
    ``torch.float32`` (``.to(torch.float32)``, ``torch.zeros(..., dtype=torch.float32)``,
    ``softmax(..., dtype=torch.float32)``). Tensors already in float64 stay so; nothing is made less precise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(_promoted(a) for a in args)
        kwargs = {k: _promoted(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def checked_precision(cfg: DictConfig) -> Iterator[None]:
    """Run the block in the checked config's precision: :class:`Float64Mode` and float64 as the default dtype in
    float64 mode; as configured otherwise."""
    if cfg.check.dtype != FLOAT64:
        yield
        return
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64Mode():
            yield
    finally:
        torch.set_default_dtype(default)


def in_checked_precision(cfg: DictConfig, device: torch.device) -> tuple[DictConfig, list[str]]:
    """The checked config in float64 mode: ``parallel.param_dtype`` and ``reduce_dtype`` float64 (the models are then
    built with float64 master weights, fsdptrain/distributed/fsdp.py), and an attention backend that has no float64
    path (flash-attn, torch_varlen) swapped for ``auto`` (the exact ``sdpa_segments``), with a note saying so. ``cfg``
    is the check's own copy; unchanged with ``check.dtype=model``."""
    if cfg.check.dtype != FLOAT64:
        return cfg, []
    notes = []
    cfg.parallel.param_dtype = cfg.parallel.reduce_dtype = FLOAT64
    backend = cfg.model.attn_backend
    if backend != "auto" and backend not in available_backends(device, torch.float64):
        notes.append(f"model.attn_backend={backend} has no float64 path: check.dtype=float64 ran the exact "
                     "sdpa_segments instead; check.dtype=model checks that kernel in the model's dtype "
                     "(docs/check-metrics.md, \"Precision\")")
        cfg.model.attn_backend = "auto"
    return cfg, notes
