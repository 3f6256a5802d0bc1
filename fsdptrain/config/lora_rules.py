"""The LoRA settings' rules that span fields (docs/lora.md), registered in :mod:`fsdptrain.config.validate` with one
line. Torch-free, like the rest of the validation; whether ``model.lora.target_modules`` names linear modules of the
model is checked by the CLI's preflight, which builds the model on the meta device (`fsdptrain/preflight.py`)."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

from fsdptrain.config.schema import LORA_ALL_LINEAR
from fsdptrain.registry.errors import ConfigError

REFUSED_WITH_LORA = (
    ("drafter.enabled", True, "the co-trained drafter reads the policy's weights as full parameters"),
    ("parallel.cpu_offload", True, "CPU offload of a model with frozen weights is not tested"),
    ("parallel.compile", True, "compiled decoder layers with adapters are not tested"),
)
"""(key, value, why): the settings LoRA is refused with, each with one line naming the combination."""


def target_module_names(target_modules) -> list[str] | None:
    """The list of module names ``model.lora.target_modules`` names, or None for ``all-linear``; ConfigError for any
    other form."""
    if isinstance(target_modules, str):
        if target_modules == LORA_ALL_LINEAR:
            return None
        raise ConfigError(f"model.lora.target_modules={target_modules!r} must be {LORA_ALL_LINEAR} or a list of "
                          "module names such as [q_proj,v_proj]")
    if not isinstance(target_modules, (list, tuple, ListConfig)) or len(target_modules) == 0 or not all(
            isinstance(name, str) and name.strip() for name in target_modules):
        raise ConfigError(f"model.lora.target_modules={target_modules!r} must be {LORA_ALL_LINEAR} or a non-empty "
                          "list of module names such as [q_proj,v_proj]")
    return [str(name) for name in target_modules]


def check_lora(cfg: DictConfig) -> None:
    """The form of ``target_modules``; the critic's adapters; the settings LoRA is refused with."""
    lora = cfg.model.lora
    target_module_names(lora.target_modules)
    if lora.critic and lora.r == 0:
        raise ConfigError("model.lora.critic=true gives the critic adapters of rank model.lora.r, which is 0: set "
                          "model.lora.r (e.g. 8) or drop model.lora.critic")
    if lora.critic and not cfg.algorithm.use_critic:
        raise ConfigError("model.lora.critic=true but algorithm.use_critic=false: there is no critic to adapt")
    if lora.critic and cfg.model.value_init == "reward_model":
        raise ConfigError("model.lora.critic=true with model.value_init=reward_model is not supported: train the "
                          "critic fully (model.lora.critic=false) or start it from the policy (model.value_init=policy)")
    if lora.r == 0:
        return
    for key, value, why in REFUSED_WITH_LORA:
        group, name = key.split(".")
        if cfg[group][name] == value:
            raise ConfigError(f"model.lora.r={lora.r} with {key}={str(value).lower()} is not supported ({why}): "
                              f"set {key}={str(not value).lower()} or model.lora.r=0")
