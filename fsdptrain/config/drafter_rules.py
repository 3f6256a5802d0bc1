"""The drafter extension's config rules that span fields (docs/drafter.md), registered in
:mod:`fsdptrain.config.validate` with one line. Torch-free, like the rest of the validation."""

from __future__ import annotations

from omegaconf import DictConfig

from fsdptrain.registry.errors import ConfigError
from fsdptrain.config.schema import DEFAULT_STEPS


def check_drafter(cfg: DictConfig) -> None:
    """The feature layers, the vocabulary's source and the steps it is counted over."""
    drafter = cfg.drafter
    layers = drafter.feature_layers
    if layers is not None and (len(layers) != 3 or any(i < 0 for i in layers)):
        raise ConfigError(f"drafter.feature_layers={list(layers)} must name 3 policy layers (indices >= 0), "
                          "or be null for vLLM's default")
    if drafter.path is not None and drafter.vocab_path is not None:
        raise ConfigError(f"drafter.path={drafter.path} brings its own vocabulary (d2t/t2d): unset "
                          f"drafter.vocab_path={drafter.vocab_path}")
    if drafter.enabled and cfg.trainer.share_prompts == "true":
        raise ConfigError("trainer.share_prompts=true is not supported with drafter.enabled=true (the drafter reads "
                          "the unshared packed row): set one of them to false")
    steps = cfg.trainer.steps if cfg.trainer.steps is not None else DEFAULT_STEPS  # epochs: checked at the run
    if drafter.enabled and drafter.vocab_path is None and drafter.path is None and drafter.vocab_from_steps > steps:
        raise ConfigError(f"drafter.vocab_from_steps={drafter.vocab_from_steps} must be at most "
                          f"trainer.steps={steps} (the drafter trains after its vocabulary is counted)")
