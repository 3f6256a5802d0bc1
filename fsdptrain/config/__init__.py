"""Configuration: the typed schema (:mod:`.schema`), its one validation pass (:mod:`.validate`) and the generated
reference (:mod:`.docs`). Torch-free: the CLI validates in the parent process before any rank starts.

The names most modules need are importable from here: ``from fsdptrain.config import ConfigError``.
"""

from fsdptrain.config.schema import SCHEMA_GROUPS, Config, register_schemas
from fsdptrain.config.validate import ConfigError, validate, validate_mesh_shape, validate_world

__all__ = ["SCHEMA_GROUPS", "Config", "ConfigError", "register_schemas", "validate", "validate_mesh_shape",
           "validate_world"]
