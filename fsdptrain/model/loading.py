"""Building transformers models on the CPU or the meta device: configs, the tiny embedded default, full weights.

transformers owns the model code; this module only builds models. Sharding is applied from outside by
fsdptrain/distributed/fsdp.py. Every dropout probability is set to 0 in the config (and any `nn.Dropout` left over to
p=0), so forwards are deterministic whatever train()/eval() mode a model is in: PPO's first-mini-batch ratio is 1 only
if they are. accelerate's `init_empty_weights` is not used: with it transformers marks modules initialised and skips a
later initialisation; `torch.device("meta")` has no such trap (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from accelerate.utils import calculate_maximum_sizes
from omegaconf import DictConfig
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from fsdptrain.config.schema import DTYPES as DTYPE_NAMES
from fsdptrain.model.checks import check_tokenizer_fits
from fsdptrain.model.location import model_location, pretrained_args
from fsdptrain.model.moe import moe_layers

logger = logging.getLogger(__name__)

TINY_CONFIG: dict[str, Any] = {  # the embedded default: a tiny Llama that trains in seconds on a CPU
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


_CHECKPOINT_WRAPPED = "._checkpoint_wrapped_module"


def resolve_config(*, path: str | None, config: Mapping[str, Any] | PretrainedConfig | None) -> PretrainedConfig:
    """The transformers config of the model: from `path` (a folder or a `.gguf` file, model/location.py), or from
    `config` (a dict holding `model_type` plus fields, or a config object; copied, never modified), with every dropout
    probability set to 0.

    Exactly one of `path` and `config` must be given.
    """
    if (path is None) == (config is None):
        raise ValueError("give exactly one of model.path (a local Hugging Face folder or .gguf file) and a model config")
    if path is not None:
        name, gguf = pretrained_args(path)
        # never the folder's code (model/checks.py)
        resolved = AutoConfig.from_pretrained(name, trust_remote_code=False, **gguf)
    elif isinstance(config, PretrainedConfig):
        resolved = copy.deepcopy(config)
    else:
        fields = dict(config)
        if "model_type" not in fields:
            raise ValueError(f"a model config dict needs a 'model_type' (e.g. 'llama'), got keys {sorted(fields)}")
        resolved = AutoConfig.for_model(fields.pop("model_type"), **fields)
    zero_dropout_in_config(resolved)
    return resolved


def zero_dropout_in_config(config: PretrainedConfig) -> None:
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float) and value != 0.0:
            setattr(config, key, 0.0)


def zero_dropout_modules(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def without_router_loss(model: nn.Module) -> None:
    """Every forward of an MoE causal LM runs with ``output_router_logits=False``, whatever its config says:
    transformers' ``load_balancing_loss_func`` reads the router's tokens against an ``attention_mask`` and cannot
    see a packed row's sequences (it fails on one, or counts padding on a padded batch); fsdptrain computes the
    load-balancing loss itself over the global batch (fsdptrain/rl/moe_aux_loss.py, docs/moe.md). A forward
    pre-hook, not a config change, so an exported config.json keeps the user's setting. No-op for a dense model and
    for a model whose forward has no such argument."""
    if not moe_layers(model) or not hasattr(model.config, "output_router_logits"):
        return

    def no_router_logits(_module, args, kwargs):
        return args, {**kwargs, "output_router_logits": False}

    model.register_forward_pre_hook(no_router_logits, with_kwargs=True)


def use_experts_for(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers' default experts kernel (``grouped_mm``) has no float64 path: a float64 MoE model (check-metrics'
    float64 mode, fsdptrain/check/precision.py) runs the ``eager`` experts (a loop over the experts, the same math);
    any other dtype keeps transformers' choice."""
    if dtype == torch.float64 and moe_layers(model):
        model.set_experts_implementation("eager")


def model_class(kind: str):
    if kind in ("policy", "reference"):
        return AutoModelForCausalLM
    if kind == "value":
        return AutoModelForTokenClassification
    raise ValueError(f"model kind must be 'policy', 'value' or 'reference', got {kind!r}")


def config_for(kind: str, config: PretrainedConfig) -> PretrainedConfig:
    if kind != "value":
        return config
    # One label: the value head maps each hidden state to a scalar, and an exported critic loads with transformers.
    config = copy.deepcopy(config)
    config.num_labels = 1
    # transformers' token-classification head falls back to dropout 0.1 when the config names none.
    config.classifier_dropout = 0.0
    return config


def build_full_model(
    kind: str,
    *,
    path: str | None,
    config: Mapping[str, Any] | PretrainedConfig | None,
    seed: int,
    backbone_from: nn.Module | None = None,
    lora=None,
) -> PreTrainedModel:
    """The whole fp32 model on the CPU (no parallelism), dropout off.

    kind: "policy" / "reference" (AutoModelForCausalLM) or "value" (AutoModelForTokenClassification, 1 label).
    From `path` the weights are loaded (a value model from a causal-LM folder gets its head from the seed);
    from `config` they are drawn from `seed`. `backbone_from`: a model whose base model (the decoder without its
    head) is copied into this one, e.g. a value model that starts from the policy's weights. `lora`: a
    `fsdptrain.model.lora.LoraSettings`; its adapters are injected last, drawn from `seed` (docs/lora.md).
    """
    auto_class = model_class(kind)
    resolved = config_for(kind, resolve_config(path=path, config=config))
    # A private RNG stream: only rank 0 builds, and the ranks' global RNG states must not drift apart.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if path is not None:
            name, gguf = pretrained_args(path)  # a GGUF file is dequantised to fp32 here
            model = _from_pretrained(kind, name, resolved, gguf)
        else:
            model = auto_class.from_config(resolved, dtype=torch.float32)
    if backbone_from is not None:
        model.base_model.load_state_dict(backbone_from.base_model.state_dict())
    zero_dropout_modules(model)
    without_router_loss(model)
    if lora is not None:
        lora.apply_to(model, seed=seed)
    return model.train()


def _from_pretrained(kind: str, name: str, config: PretrainedConfig, gguf: dict) -> PreTrainedModel:
    """The weights of ``name`` in the model of ``kind``. A value model's head is missing from a causal LM's
    checkpoint and drawn on purpose (`value_head_names`; the run says so in a line of its own,
    `fsdptrain.train.setup.critic_head_line`), so transformers' load report of that load, which calls it MISSING
    and bids to train it, is silenced; any other weight the checkpoint lacks is still reported, here."""
    args = dict(config=config, dtype=torch.float32, trust_remote_code=False, **gguf)
    if kind != "value":
        return model_class(kind).from_pretrained(name, **args)
    with transformers_quiet():
        model, info = model_class(kind).from_pretrained(name, output_loading_info=True, **args)
    head = set(value_head_names(model))
    lacking = sorted(key for key in info["missing_keys"] if key.split(".")[0] not in head)
    if lacking:
        logger.warning("the value model's checkpoint %s lacks %s: drawn at random", name, ", ".join(lacking))
    return model


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' logging at errors only, for the block (its verbosity restored after)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def value_head_names(model: nn.Module) -> list[str]:
    """The modules of a value model outside its backbone (``score``: the head mapping a hidden state to a value)."""
    return [name for name, child in model.named_children()
            if name != model.base_model_prefix and next(child.parameters(), None) is not None]


def meta_model(kind: str, config: PretrainedConfig, *, lora=None) -> PreTrainedModel:
    """The architecture of `kind` on the meta device, with the adapters of `lora` (LoraSettings) when given."""
    with torch.device("meta"):
        model = model_class(kind).from_config(config_for(kind, config), dtype=torch.float32)
    zero_dropout_modules(model)
    without_router_loss(model)
    if lora is not None:
        with torch.device("meta"):
            lora.apply_to(model, seed=0)  # no values drawn on meta: the weights come from rank 0
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that train: those with ``requires_grad`` (docs/architecture.md, "Trainable parameters").

    The one definition the optimizer, gradient clipping and its norm, the non-finite guard, the memory report,
    checkpoints and check-metrics' gradients read: under LoRA the adapters (and a value head), else every weight.
    A frozen weight gets no gradient buffer, no optimizer state and no place in a norm.
    """
    return [param for param in model.parameters() if param.requires_grad]


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers left out of the state dict (RoPE inv_freq), keyed by their module path (wrappers included)."""
    persistent = set(model.state_dict().keys())  # names without activation-checkpoint wrappers
    return {name: buf for name, buf in model.named_buffers() if clean_name(name) not in persistent}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers: the one whose blocks are the model's `_no_split_modules` classes (also
    after FSDP2 sharding)."""
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            inner = [_unwrap(block) for block in module]
            # by the class or a base: fully_shard swaps in a subclass (FSDP<Name>) of the layer's class
            if all(any(cls.__name__ in no_split for cls in type(block).__mro__) for block in inner):
                return module
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: no nn.ModuleList of its _no_split_modules "
        f"{sorted(no_split)}; this model architecture is not supported"
    )


def _unwrap(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


def _format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def describe_model_memory(model: nn.Module, *, num_shards: int = 1) -> str:
    """One line: parameter count, weight size, largest layer (accelerate's `calculate_maximum_sizes`) and an
    estimate of the training state per rank when sharded `num_shards` ways.

    The estimate counts the weights as stored (fp32; frozen ones under LoRA may be in the param dtype) and fp32
    gradients and AdamW's two fp32 moments of the trainable ones (16 bytes per fp32 trainable parameter) divided by
    `num_shards`, plus one unsharded largest layer (the all-gather); activations are not included.
    Works on a plain, meta or sharded model (DTensor sizes are global).
    """
    total_bytes, (largest_bytes, largest_names) = calculate_maximum_sizes(model)
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in trainable_parameters(model))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # frozen ones may be bf16
    # the weights as stored; fp32 gradients and AdamW's two fp32 moments of the trainable ones only
    per_rank = (weight_bytes + 12 * num_trainable) / num_shards + largest_bytes
    largest = ", ".join(clean_name(name) for name in largest_names) or "-"
    trainable = "" if num_trainable == num_params else f" ({num_trainable / 1e6:.2f} M trainable)"
    return (
        f"{type(model).__name__}: {num_params / 1e6:.2f} M parameters{trainable}, {_format_bytes(total_bytes)} of "
        f"weights; largest layer {largest} ({_format_bytes(largest_bytes)}); training state per rank at {num_shards} "
        f"shard(s) ~{_format_bytes(per_rank)} (fp32 weights, grads, 2 AdamW moments, one gathered layer; "
        f"activations not included)"
    )


def clean_name(name: str) -> str:
    return name.replace(_CHECKPOINT_WRAPPED, "")


DTYPES = {name: getattr(torch, name) for name in (*DTYPE_NAMES, "float64")}
"""The torch dtype of each name `parallel.*_dtype` and `drafter.export_dtype` accept, and float64, which only
check-metrics' checked config sets (fsdptrain/check/precision.py)."""


def model_path(cfg: DictConfig) -> str | None:
    """The run's pretrained model as one location (a folder or a .gguf file, model/location.py); None: config-built."""
    return model_location(cfg.model.path, cfg.model.gguf_file)


def max_positions(cfg: DictConfig) -> int | None:
    """How many positions the run's model is valid at: its config's ``max_position_embeddings`` (``model.path``'s, or
    the config-built model's); None when its config names none. RoPE computes angles past it too, at positions the
    model never saw: the data paths drop or refuse rows that would reach them (docs/your-task.md)."""
    path = model_path(cfg)
    if path is None:
        return TINY_CONFIG["max_position_embeddings"]
    return getattr(resolve_config(path=path, config=None), "max_position_embeddings", None)


def build_tokenizer(cfg: DictConfig):
    """The bundled tokenizer, or the one of the user's model folder or GGUF file (left padding; pad falls back to
    EOS)."""
    if model_path(cfg) is None:
        from fsdptrain.data.tokenizer import load_bundled_tokenizer

        return load_bundled_tokenizer()
    from transformers import AutoTokenizer

    name, gguf = pretrained_args(model_path(cfg))
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False, **gguf)
    check_tokenizer_fits(tokenizer, cfg.model.path)  # before any model is built: one line, exit 2
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_model_config(cfg: DictConfig, tokenizer) -> dict:
    """The config-built model's transformers config: ``TINY_CONFIG`` with the sizes of ``cfg.model``, sized to the
    tokenizer."""
    return {
        **TINY_CONFIG,
        "model_type": cfg.model.arch,
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.model.hidden_size,
        "intermediate_size": cfg.model.intermediate_size,
        "num_hidden_layers": cfg.model.num_layers,
        "num_attention_heads": cfg.model.num_heads,
        "num_key_value_heads": cfg.model.num_kv_heads,
        "tie_word_embeddings": cfg.model.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def model_source(cfg: DictConfig, tokenizer) -> dict:
    """Where the policy's weights come from: ``model.path`` (a folder or .gguf file), else the config-built model."""
    path = model_path(cfg)
    return dict(path=path, config=None if path else tiny_model_config(cfg, tokenizer))
