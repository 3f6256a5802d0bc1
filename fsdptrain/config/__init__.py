"""Configuration: the typed schema (:mod:`.schema`), its one validation pass (:mod:`.validate`) and the generated
reference (:mod:`.docs`). Torch-free: the CLI validates in the parent process before any rank starts.

The names most modules need are importable from here: ``from fsdptrain.config import ConfigError``.
"""

from fsdptrain.registry.errors import ConfigError
from fsdptrain.config.schema import DEFAULT_STEPS, SCHEMA_GROUPS, Config, register_schemas
from fsdptrain.config.validate import (
    multi_turn,
    reward_specs,
    trainer_ranks,
    validate,
    validate_mesh_shape,
    validate_world,
)

__all__ = ["DEFAULT_STEPS", "SCHEMA_GROUPS", "Config", "ConfigError", "multi_turn", "register_schemas", "reward_specs", "trainer_ranks", "validate",
           "validate_mesh_shape", "validate_world"]
