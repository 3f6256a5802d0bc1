"""check-metrics' largest-difference helpers keep a NaN (fsdptrain/check/compare.py ``worst_of``): a layout whose
gradient, log-prob or correction weight came out NaN must fail, never pass as the difference found before it.
Python's ``max(0.0, nan)`` is 0.0, which is how a NaN used to vanish."""

from __future__ import annotations

import math

import pytest
import torch

from fsdptrain.check.compare import Outcome, compare, worst_of
from fsdptrain.check.experience_reference import max_difference
from fsdptrain.check.layouts import grad_max_diff


def test_worst_of_keeps_a_nan_on_either_side_and_is_max_otherwise():
    assert math.isnan(worst_of(0.0, math.nan)) and math.isnan(worst_of(math.nan, 3.0))
    assert worst_of(1.0, 2.5) == 2.5 and worst_of(2.5, 1.0) == 2.5


@pytest.mark.parametrize("where", [0, 1])
def test_a_nan_gradient_entry_is_a_nan_difference_and_fails_the_comparison(where):
    reference = {"a.weight": torch.tensor([1.0, 2.0]), "b.weight": torch.tensor([3.0])}
    grads = {"a.weight": torch.tensor([1.0, 2.0]), "b.weight": torch.tensor([3.0])}
    grads["b.weight" if where else "a.weight"][0] = math.nan
    diff = grad_max_diff(grads, reference)
    assert math.isnan(diff)
    (row,) = compare(Outcome("reference", {"actor/grad_max_diff": 0.0}),
                     Outcome("packed", {"actor/grad_max_diff": diff}), rtol=1e-5, atol=1e-8, scales={})
    assert not row.passed


def test_a_nan_token_is_a_nan_difference():
    worst, scale = max_difference([[0.5, math.nan, 0.25]], [[0.5, 0.75, 0.25]])
    assert math.isnan(worst) and scale == 0.75
    assert max_difference([[0.5, 0.7]], [[0.5, 0.75]])[0] == pytest.approx(0.05, abs=1e-15)


def test_padded_log_probs_row_by_row_equal_the_whole_batch_log_softmax_and_its_gradient():
    """The padded layout's log-probs and entropy (each row recomputed in backward, fsdptrain/check/layouts.py) are
    the plain log-softmax and entropy of the whole [B, L, V] logits, value and gradient."""
    from fsdptrain.check.layouts import padded_logprobs_entropy
    from fsdptrain.check.precision import Float64Mode
    from fsdptrain.rl.policy_loss import entropy_from_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    results = []
    for rowwise in (True, False):
        x = logits.clone().requires_grad_(True)
        with Float64Mode():  # as check-metrics runs it: the layout's .float() stays float64
            if rowwise:
                logprobs, entropy = padded_logprobs_entropy(x, labels, 0.7)
            else:
                scaled = x / 0.7
                logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, labels[..., None])[..., 0]
                entropy = entropy_from_logits(scaled)
            ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), x.grad))
    for got, want in zip(*results):
        assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-14, atol=1e-14)
