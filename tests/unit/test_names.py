"""The config's name tuples are the numerics' registry keys, and the config stays torch-free."""

import subprocess
import sys

from fsdptrain.rl import aggregate, names, policy


def test_kl_registry_keys_are_the_names():
    assert tuple(policy._KL) == names.KL_ESTIMATORS


def test_agg_modes_are_the_names():
    assert aggregate.AGG_MODES is names.AGG_MODES


def test_config_imports_no_torch():
    code = "import fsdptrain.config, fsdptrain.rl.names, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
