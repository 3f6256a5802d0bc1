"""The rules of an ``fsdptrain sft`` config (``data.source=sft``; docs/sft.md), registered in
:mod:`fsdptrain.config.validate` with one line. Torch-free.

Supervised fine-tuning trains on the demonstrations it is given: there is no algorithm, no sampling, no reward and no
critic, so a setting of those parts is refused (one line naming it) rather than silently ignored. The rules read the
composed config, so a value is refused whatever set it: an override, a preset, or the user's own config file
(``--config-dir``/``--config-name``).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config.schema import AlgorithmConfig, RewardConfig, RolloutConfig
from fsdptrain.registry.errors import ConfigError


def fine_tuning(cfg: DictConfig) -> bool:
    """Whether the config is an ``fsdptrain sft`` run's (``data.source=sft``)."""
    return cfg.data.source == "sft"


def _first_changed(value, default, key: str) -> tuple[str, object] | None:
    """``(dotted key, value)`` of the first leaf of ``value`` (a plain container) that differs from ``default``'s."""
    if isinstance(value, dict) and isinstance(default, dict):
        for name in default:
            changed = _first_changed(value.get(name), default[name], f"{key}.{name}")
            if changed is not None:
                return changed
        return None
    return None if value == default else (key, value)


def check_sft(cfg: DictConfig) -> None:
    """Refuse what supervised fine-tuning does not use (algorithm.* with a teacher, rollout.*, reward.*, the
    drafter, context parallelism) and a mini-batch split that does not divide ``sft.rows_per_step``."""
    if not fine_tuning(cfg):
        return
    for name, schema in (("algorithm", AlgorithmConfig), ("rollout", RolloutConfig), ("reward", RewardConfig)):
        default = OmegaConf.to_container(OmegaConf.structured(schema), resolve=True)
        changed = _first_changed(OmegaConf.to_container(cfg[name], resolve=True), default, name)
        if changed is not None:
            key, value = changed
            raise ConfigError(f"{key}={value!r} does not apply to fsdptrain sft, which trains on the demonstrations "
                              f"of data.path (no algorithm, no sampling, no reward): drop it, from the command line "
                              f"or from your config file (docs/sft.md)")
    for key, off in (("drafter.enabled", False), ("parallel.cp", 1)):
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
