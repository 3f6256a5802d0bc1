"""The config's name tuples are the numerics' registry keys, and the config stays torch-free."""

import subprocess
import sys

import pytest
import torch

from fsdptrain.registry import names
from fsdptrain.rl import policy_loss
from fsdptrain.rl.aggregate import agg_loss

# Two padded sequences: s = (1 + 2, 3) = (3, 3), c = (2, 1); N = 3 tokens, S = 2 sequences, width 3.
LOSS = torch.tensor([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
AGG_BY_HAND = {
    "token-mean": 6 / 3,
    "token-sum": 6.0,
    "seq-mean-token-sum": 6 / 2,
    "seq-mean-token-sum-norm": 6 / 2 / 3,
    "seq-mean-token-mean": (3 / 2 + 3 / 1) / 2,
}


def test_kl_registry_keys_are_the_names():
    assert tuple(policy._KL) == names.KL_ESTIMATORS


def test_agg_modes_are_the_names():
    """The names the config offers are exactly the modes worked out by hand below, in the same order."""
    assert names.AGG_MODES == tuple(AGG_BY_HAND)


@pytest.mark.parametrize("mode", names.AGG_MODES)
def test_agg_loss_dispatches_each_name_to_its_own_formula(mode):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(AGG_BY_HAND[mode], rel=1e-7)


def test_agg_loss_refuses_a_name_not_in_the_list():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "seq-sum")


def test_config_imports_no_torch():
    code = "import fsdptrain.config, fsdptrain.registry.names, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
