"""`zero_grads` clears an FSDP2 model's gradients after a no-grad forward, where `module.zero_grad` does not: the
root unit stays unsharded after that forward, `parameters()` then yields its unsharded tensors, and the sharded
gradients of the embedding and the final norm survive into the next backward (2 gloo ranks)."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    result = launch("zero_grad_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("zero_grads"), timeout_s=300)
    return result.checked(2).results


def test_zero_grads_gives_the_first_backwards_gradients_again(records):
    for rank in (0, 1):
        assert records[rank]["zero_grads/root_left_unsharded"] is True  # the trap was set
        assert records[rank]["zero_grads/largest_difference"] == 0.0, records[rank]


def test_module_zero_grad_falls_into_the_trap(records):
    """The torch behaviour `zero_grads` exists for; when a torch release changes it, this test says so."""
    for rank in (0, 1):
        assert records[rank]["module_zero_grad/root_left_unsharded"] is True
        assert records[rank]["module_zero_grad/largest_difference"] > 1e-3, records[rank]
