"""LoRA adapters on a transformers model, through peft (docs/lora.md).

The adapters are injected into the transformers model in place (`peft.inject_adapter_in_model`: the model keeps its
class and its forward; each adapted ``nn.Linear`` becomes peft's ``lora.Linear`` holding ``base_layer``, ``lora_A``
and ``lora_B``), before fsdptrain/distributed/fsdp.py shards it. peft freezes every other weight; the value model's
head is made trainable again (``LoraSettings.trainable_head``). Which parameters train is then read from
``requires_grad`` alone (`fsdptrain.model.loading.trainable_parameters`).

``lora_B`` starts at zero (peft's default), so a model with fresh adapters computes exactly what its base does.
peft is an optional extra (``pip install 'fsdptrain[lora]'``): it is imported only when adapters are asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from omegaconf import DictConfig

from fsdptrain.config.lora_rules import target_module_names
from fsdptrain.model.loading import decoder_layers

PEFT_MISSING = "model.lora.r > 0 needs peft, which is not installed: pip install 'fsdptrain[lora]'"
"""The one line a run with adapters but without peft stops with."""

ADAPTER_NAME = "default"
"""peft's adapter name; the only adapter a model holds."""


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of one model: rank ``r`` (> 0), scale ``alpha / r``, dropout on their input, the module names
    they go on (None: every linear module of the decoder layers), and whether the model's head (the value head)
    trains with them."""

    r: int
    alpha: float
    dropout: float
    target_modules: Optional[tuple[str, ...]] = None
    trainable_head: bool = False

    def apply_to(self, model: nn.Module, *, seed: int) -> nn.Module:
        """`apply_lora` with these settings (what fsdptrain/model/loading.py calls, without importing this module)."""
        return apply_lora(model, self, seed=seed)


def linear_module_names(model: nn.Module) -> list[str]:
    """The names (last path component) of the ``nn.Linear`` modules inside the decoder layers, sorted: what
    ``all-linear`` adapts. The output head and a value head lie outside the layers and are never among them."""
    names = set()
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and name:
                names.add(name.rpartition(".")[2])
    return sorted(names)


def resolve_target_modules(model: nn.Module, target_modules: Optional[tuple[str, ...]]) -> list[str]:
    """The module names the adapters go on: every linear module name for None, else ``target_modules`` after checking
    that each is the name of a linear module of the decoder layers (ValueError naming the ones there are)."""
    linear = linear_module_names(model)
    if target_modules is None:
        return linear
    unknown = [name for name in target_modules if name not in linear]
    if unknown:
        raise ValueError(f"model.lora.target_modules: {', '.join(map(repr, unknown))} {'matches' if len(unknown) == 1 else 'match'} no linear module of "
                         f"{type(model).__name__}; its linear modules are: {', '.join(linear)}")
    return list(target_modules)


def peft_config(model: nn.Module, settings: LoraSettings):
    """peft's ``LoraConfig`` of ``settings`` for ``model`` (the names resolved, no bias training)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=resolve_target_modules(model, settings.target_modules), bias="none")


def apply_lora(model: nn.Module, settings: LoraSettings, *, seed: int) -> nn.Module:
    """Inject the adapters into ``model`` in place and freeze every other weight (the head stays trainable when
    ``settings.trainable_head``); ``lora_A`` is drawn from ``seed`` on a private RNG stream (every rank's global RNG
    stays where it was). Works on a CPU or a meta model; returns ``model``."""
    from peft import inject_adapter_in_model

    on_meta = next(model.parameters()).is_meta
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(model, settings), model, adapter_name=ADAPTER_NAME,
                                low_cpu_mem_usage=on_meta)
    if settings.trainable_head:
        prefix = model.base_model_prefix + "."
        for name, param in model.named_parameters():
            if not name.startswith(prefix):
                param.requires_grad_(True)
    return model


def has_adapters(model: nn.Module) -> bool:
    """Whether peft adapters were injected into ``model``."""
    return any(_is_tuner_layer(module) for module in model.modules())


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Turn every adapter of ``model`` on or off (peft's ``enable_adapters``, what ``PeftModel.disable_adapter``
    does): off, the model computes its base model's outputs. peft also turns the adapters' ``requires_grad`` off and
    back on; on a sharded model call it only while every unit is resharded (see
    `fsdptrain.distributed.fsdp.adapters_disabled`)."""
    for module in model.modules():
        if _is_tuner_layer(module):
            module.enable_adapters(enabled)


def _is_tuner_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(module, BaseTunerLayer)


def lora_settings(cfg: DictConfig, *, critic: bool = False) -> Optional[LoraSettings]:
    """The adapters of the policy (or, with ``critic``, of the value model, whose head then trains too) from
    ``model.lora``; None when that model trains every weight."""
    lora = cfg.model.lora
    if lora.r == 0 or (critic and not lora.critic):
        return None
    names = target_module_names(lora.target_modules)
    return LoraSettings(r=lora.r, alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=None if names is None else tuple(names), trainable_head=critic)
