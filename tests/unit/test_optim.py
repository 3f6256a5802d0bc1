"""optim: the LR schedule by hand, clipping and the non-finite guard in one process (no process group)."""

import math

import pytest
import torch

from fsdptrain.train.optim import (
    NonFiniteGradientError,
    NonFiniteGuard,
    build_optimizer,
    build_scheduler,
    clip_grad_norm_,
    lr_factor,
)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.25),  # warmup (step + 1) / 4
        (1, 0.5),
        (3, 1.0),
        (4, 1.0),  # cosine progress 0
        (6, 0.1 + 0.45 * (1 + math.sqrt(0.5))),  # progress 2/8: 0.1 + 0.9 * (1 + cos(pi/4)) / 2
        (8, 0.55),  # progress 1/2: 0.1 + 0.9 * (1 + 0) / 2
        (12, 0.1),  # progress 1: min_lr_ratio
        (20, 0.1),  # past total_steps: stays at the floor
    ],
)
def test_warmup_then_cosine(step, expected):
    got = lr_factor(step, warmup_steps=4, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("warmup", "step", "expected"), [(2, 0, 0.5), (2, 1, 1.0), (2, 50, 1.0), (0, 0, 1.0)])
def test_warmup_then_constant(warmup, step, expected):
    assert lr_factor(step, warmup_steps=warmup, total_steps=10, schedule="constant", min_lr_ratio=0.0) == expected


def test_scheduler_drives_the_optimizer():
    model = torch.nn.Linear(2, 1)
    opt = build_optimizer(model, lr=0.2, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
    sched = build_scheduler(opt, warmup_steps=4, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.15], abs=1e-12)  # 0.2 x 1/4, 2/4, 3/4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(warmup_steps=0, total_steps=10, schedule="linear", min_lr_ratio=0.0),
        dict(warmup_steps=-1, total_steps=10, schedule="cosine", min_lr_ratio=0.0),
        dict(warmup_steps=0, total_steps=0, schedule="cosine", min_lr_ratio=0.0),
        dict(warmup_steps=0, total_steps=10, schedule="cosine", min_lr_ratio=1.5),
    ],
)
def test_scheduler_rejects_bad_settings(kwargs):
    opt = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError):
        build_scheduler(opt, **kwargs)


def test_optimizer_skips_frozen_parameters_and_rejects_bad_lr():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    assert sum(len(g["params"]) for g in opt.param_groups) == 2  # the second Linear's weight and bias
    with pytest.raises(ValueError):
        build_optimizer(model, lr=0.0, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def _params_with_grads(*grads):
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros(len(grad)))
        p.grad = torch.tensor(grad)
        params.append(p)
    return params


def test_clip_scales_to_max_norm_and_returns_the_preclip_norm():
    params = _params_with_grads([3.0, 4.0], [12.0])  # norm sqrt(9 + 16 + 144) = 13
    norm = clip_grad_norm_(params, 6.5)
    assert float(norm) == 13.0
    coef = 6.5 / (13.0 + 1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]) * coef, rtol=1e-7, atol=0)
    torch.testing.assert_close(params[1].grad, torch.tensor([12.0]) * coef, rtol=1e-7, atol=0)


@pytest.mark.parametrize("max_norm", [None, 0.0, -1.0, 20.0])
def test_no_clip_still_returns_the_norm(max_norm):
    params = _params_with_grads([3.0, 4.0], [12.0])
    assert float(clip_grad_norm_(params, max_norm)) == 13.0
    assert params[0].grad.tolist() == [3.0, 4.0] and params[1].grad.tolist() == [12.0]


def test_nonfinite_norm_leaves_gradients_untouched():
    params = _params_with_grads([3.0, float("inf")], [12.0])
    assert math.isinf(float(clip_grad_norm_(params, 1.0)))
    assert params[1].grad.tolist() == [12.0]


def test_guard_skips_warns_counts_and_stops():
    guard = NonFiniteGuard(max_in_a_row=3)
    with pytest.warns(RuntimeWarning, match="1 in a row, 1 in total"):
        assert guard.should_skip(float("nan"))
    with pytest.warns(RuntimeWarning, match="2 in a row, 2 in total"):
        assert guard.should_skip(torch.tensor(float("inf")))
    assert not guard.should_skip(torch.tensor(5.0))  # finite: step, and the run of skips restarts
    assert (guard.num_in_a_row, guard.num_skipped) == (0, 2)
    for expected_total in (3, 4):
        with pytest.warns(RuntimeWarning):
            assert guard.should_skip(float("nan"))
        assert guard.num_skipped == expected_total
    with pytest.raises(NonFiniteGradientError, match="3 in a row, 5 in total"):
        guard.should_skip(float("-inf"))


def test_guard_rejects_a_zero_limit():
    with pytest.raises(ValueError):
        NonFiniteGuard(max_in_a_row=0)
