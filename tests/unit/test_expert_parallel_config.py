"""``parallel.ep``'s config rules (fsdptrain/config/validate.py): each layout or feature expert parallelism does not
compose with is one line naming it and the way out; ep must divide the data-parallel ranks."""

from __future__ import annotations

import pytest

from fsdptrain.config import ConfigError, validate_world
from fsdptrain.config.compose import compose_config


@pytest.mark.parametrize(("override", "named"), [
    ("parallel.dp_replicate=2", "parallel.dp_replicate=2 (HSDP): set parallel.dp_replicate=1"),
    ("parallel.cp=2", "parallel.cp=2: set parallel.cp=1"),
    ("model.lora.r=8", "model.lora.r=8 (LoRA): set model.lora.r=0"),
    ("rollout.placement=separate", "rollout.placement=separate: set rollout.placement=colocated"),
    ("parallel.compile=true", "parallel.compile=true: set parallel.compile=false"),
    ("parallel.cpu_offload=true", "parallel.cpu_offload=true: set parallel.cpu_offload=false"),
])
def test_what_ep_does_not_compose_with_is_one_line(override, named):
    with pytest.raises(ConfigError) as error:
        compose_config(["parallel.ep=2", override])
    assert str(error.value) == f"parallel.ep=2 does not compose with {named} or parallel.ep=1 (docs/moe.md)"


def test_ep_divides_the_data_parallel_ranks():
    cfg = compose_config(["parallel.ep=2"])
    assert validate_world(cfg, 4) == (1, 4)
    with pytest.raises(ConfigError, match=r"^parallel.ep=2 must divide the 3 data-parallel ranks: launch a multiple"):
        validate_world(cfg, 3)
    assert validate_world(compose_config(["parallel.ep=1"]), 3) == (1, 3)
