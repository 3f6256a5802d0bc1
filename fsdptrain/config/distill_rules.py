"""The on-policy distillation settings' rules that span fields (docs/algorithms.md, "On-policy distillation"),
registered in :mod:`fsdptrain.config.validate` with one line. Torch-free; whether the teacher folder or GGUF file is
usable and its tokenizer is the student's is checked by the CLI's preflight (`fsdptrain/preflight.py`)."""

from __future__ import annotations

from omegaconf import DictConfig

from fsdptrain.registry.errors import ConfigError


def distilling(cfg: DictConfig) -> bool:
    """Whether the run distills from a teacher (``algorithm.distill.teacher`` is set)."""
    return cfg.algorithm.distill.teacher is not None


def check_distill(cfg: DictConfig) -> None:
    """Distillation needs no critic and refuses one (its advantage is the per-token reverse KL, not a value
    baseline); ``task_reward=add`` without a teacher is a mistake, not a no-op."""
    distill = cfg.algorithm.distill
    if not distilling(cfg):
        if distill.task_reward != "ignore":
            raise ConfigError(f"algorithm.distill.task_reward={distill.task_reward} needs a teacher: set "
                              "algorithm.distill.teacher=PATH (a model folder or .gguf file) or drop task_reward")
        return
    if cfg.algorithm.use_critic:
        raise ConfigError(f"algorithm.distill.teacher={distill.teacher!r}: on-policy distillation's advantage is the "
                          "per-token reverse KL, with no value model; set algorithm=grpo (or algorithm.use_critic="
                          "false with adv_estimator grpo, rloo or reinforce_plus_plus_baseline)")
