"""The rules of an ``fsdptrain sft`` config (``data.source=sft``; docs/sft.md), registered in
:mod:`fsdptrain.config.validate` with one line. Torch-free.

Supervised fine-tuning trains on the demonstrations it is given: there is no sampling, no reward and no critic, so a
setting of those parts is refused (one line naming it) rather than silently ignored.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from fsdptrain.config.schema import RewardConfig, RolloutConfig
from fsdptrain.registry.errors import ConfigError


def fine_tuning(cfg: DictConfig) -> bool:
    """Whether the config is an ``fsdptrain sft`` run's (``data.source=sft``)."""
    return cfg.data.source == "sft"


def _first_changed(group: DictConfig, schema: type) -> str | None:
    """The first field of ``group`` whose value differs from the schema's default, or None."""
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if group[f.name] != default:
            return f.name
    return None


def check_sft(cfg: DictConfig) -> None:
    """Refuse what supervised fine-tuning does not use (rollout.*, reward.*, a teacher, the drafter, context
    parallelism) and a mini-batch split that does not divide ``sft.rows_per_step``."""
    if not fine_tuning(cfg):
        return
    for name, schema in (("rollout", RolloutConfig), ("reward", RewardConfig)):
        changed = _first_changed(cfg[name], schema)
        if changed is not None:
            raise ConfigError(f"{name}.{changed}={cfg[name][changed]!r} does not apply to fsdptrain sft, which "
                              f"trains on the demonstrations of data.path (no sampling, no reward): drop it")
    for key, off in (("algorithm.distill.teacher", None), ("drafter.enabled", False), ("parallel.cp", 1)):
        group, field = key.rsplit(".", 1)
        value = _select(cfg, group)[field]
        if value != off:
            raise ConfigError(f"{key}={value!r} does not apply to fsdptrain sft: drop it (docs/sft.md)")
    rows, minis = cfg.sft.rows_per_step, cfg.trainer.mini_batches_per_step
    if rows % minis != 0:
        raise ConfigError(f"trainer.mini_batches_per_step={minis} must divide sft.rows_per_step={rows}")


def _select(cfg: DictConfig, dotted: str) -> DictConfig:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node
