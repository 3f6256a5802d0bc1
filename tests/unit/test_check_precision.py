"""check-metrics' float64 mode (fsdptrain/check/precision.py) and the update pass's smooth optimiser."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from fsdptrain.check.precision import Float64Mode, checked_precision, in_checked_precision, tolerances
from fsdptrain.check.update_pass import smooth_optimizer


def _cfg(dtype="float64", rtol=None, atol=None, backend="auto"):
    return OmegaConf.create({"check": {"dtype": dtype, "rtol": rtol, "atol": atol},
                             "parallel": {"param_dtype": "float32", "reduce_dtype": "float32"},
                             "model": {"attn_backend": backend}})


def test_float32_requests_give_float64_inside_the_mode_only():
    x = torch.tensor([1.0 / 3.0], dtype=torch.float64)
    with Float64Mode():
        assert x.float().dtype == torch.float64 and x.to(torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert torch.softmax(x, 0, dtype=torch.float32).dtype == torch.float64
        assert x.to(torch.float32).item() == 1.0 / 3.0  # not rounded through float32
    assert x.float().dtype == torch.float32  # outside the mode, as asked


def test_llama_rms_norm_keeps_float64_under_the_checked_precision():
    """HF's RMSNorm computes its variance after ``.to(torch.float32)``: without the mode a float64 input comes back
    rounded to float32 precision (about 1e-8 relative); with it the result is float64 exact (1e-16)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(8, eps=1e-6).double()
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    want = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    plain = (norm(x) - want).abs().max().item()
    with checked_precision(_cfg()):
        checked = (norm(x) - want).abs().max().item()
    assert plain > 1e-9  # the float32 round trip the mode removes
    assert checked < 1e-14


def test_default_tolerances_follow_the_dtype_and_explicit_ones_win():
    assert tolerances(_cfg()) == (1e-9, 1e-10)
    assert tolerances(_cfg("model")) == (1e-5, 1e-6)
    assert tolerances(_cfg(rtol=2e-2, atol=1e-3)) == (2e-2, 1e-3)


def test_float64_mode_sets_the_dtypes_and_swaps_a_backend_without_float64():
    cfg, notes = in_checked_precision(_cfg(backend="flash_attn"), torch.device("cpu"))
    assert (cfg.parallel.param_dtype, cfg.parallel.reduce_dtype, cfg.model.attn_backend) == ("float64", "float64",
                                                                                               "auto")
    assert len(notes) == 1 and "flash_attn" in notes[0]
    cfg, notes = in_checked_precision(_cfg("model", backend="sdpa_segments"), torch.device("cpu"))
    assert (cfg.parallel.param_dtype, cfg.model.attn_backend, notes) == ("float32", "sdpa_segments", [])


def test_the_smooth_optimizer_first_step_moves_the_weights_as_far_as_adamw_would():
    model = torch.nn.Linear(4, 3).double()  # P = 15
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.01)
    norm = sum(float(p.grad.square().sum()) for p in model.parameters()) ** 0.5
    before = [p.detach().clone() for p in model.parameters()]
    smooth_optimizer(model, 1e-3, norm).step()
    moved = sum(float((p.detach() - b).square().sum()) for p, b in zip(model.parameters(), before)) ** 0.5
    assert moved == pytest.approx(1e-3 * 15 ** 0.5, rel=1e-12)
