"""Hugging Face policy, value and reference models, sharded with FSDP2.

transformers owns the model code; this module only builds models and applies parallelism to them, in this order:

    rank 0: the full fp32 model on the CPU (from `path`, or from a config and the seed) -> its state dict
    every rank: the same architecture on the meta device -> parallelize (activation checkpointing, then
    fully_shard per decoder layer, then the root) -> to_empty -> set_model_state_dict(full, broadcast from rank 0)
    -> non-persistent buffers (RoPE inv_freq) broadcast from rank 0

Random initialisation happens once, on rank 0's CPU, so the weights are the same at any world size; a sharded model
never draws random numbers (DTensor random init on a CPU mesh differs from a single-process init, platform notes).
accelerate's `init_empty_weights` is not used: with it transformers marks modules initialised and skips later
initialisation (platform notes); `torch.device("meta")` has no such trap.

The root FSDP unit (embedding, final norm, output head; one unit, so tied embeddings stay tied) never reshards after
forward. A chunked loss that runs after the forward can therefore read `model.get_output_embeddings().weight` as a
plain, unsharded tensor (see `output_projection_weight`); its gradient accumulates into that unsharded parameter and is
reduce-scattered with the rest of the root unit when backward finishes.

Every dropout probability is set to 0 in the config (and any `nn.Dropout` left over to p=0), so forwards are
deterministic whatever train()/eval() mode a model is in: PPO's first-mini-batch ratio is 1 only if they are.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed
from accelerate.utils import calculate_maximum_sizes
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from fsdptrain.distributed import world

# The embedded default: a tiny Llama that trains in seconds on a CPU.
TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

_CHECKPOINT_WRAPPED = "._checkpoint_wrapped_module"


# ---------------------------------------------------------------------------------------------------------------
# Configs and full (unsharded) models on the CPU
# ---------------------------------------------------------------------------------------------------------------


def resolve_config(*, path: str | None, config: Mapping[str, Any] | PretrainedConfig | None) -> PretrainedConfig:
    """The transformers config of the model: from the folder `path`, or from `config` (a dict holding `model_type`
    plus fields, or a config object; copied, never modified), with every dropout probability set to 0.

    Exactly one of `path` and `config` must be given.
    """
    if (path is None) == (config is None):
        raise ValueError("give exactly one of model.path (a local Hugging Face folder) and a model config")
    if path is not None:
        resolved = AutoConfig.from_pretrained(path)
    elif isinstance(config, PretrainedConfig):
        resolved = copy.deepcopy(config)
    else:
        fields = dict(config)
        if "model_type" not in fields:
            raise ValueError(f"a model config dict needs a 'model_type' (e.g. 'llama'), got keys {sorted(fields)}")
        resolved = AutoConfig.for_model(fields.pop("model_type"), **fields)
    _zero_dropout_in_config(resolved)
    return resolved


def _zero_dropout_in_config(config: PretrainedConfig) -> None:
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float) and value != 0.0:
            setattr(config, key, 0.0)


def _zero_dropout_modules(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _model_class(kind: str):
    if kind in ("policy", "reference"):
        return AutoModelForCausalLM
    if kind == "value":
        return AutoModelForTokenClassification
    raise ValueError(f"model kind must be 'policy', 'value' or 'reference', got {kind!r}")


def _config_for(kind: str, config: PretrainedConfig) -> PretrainedConfig:
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
) -> PreTrainedModel:
    """The whole fp32 model on the CPU (no parallelism), dropout off.

    kind: "policy" / "reference" (AutoModelForCausalLM) or "value" (AutoModelForTokenClassification, 1 label).
    From `path` the weights are loaded (a value model from a causal-LM folder gets its head from the seed);
    from `config` they are drawn from `seed`. `backbone_from`: a model whose base model (the decoder without its
    head) is copied into this one, e.g. a value model that starts from the policy's weights.
    """
    model_class = _model_class(kind)
    resolved = _config_for(kind, resolve_config(path=path, config=config))
    # A private RNG stream: only rank 0 builds, and the ranks' global RNG states must not drift apart.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if path is not None:
            model = model_class.from_pretrained(path, config=resolved, dtype=torch.float32)
        else:
            model = model_class.from_config(resolved, dtype=torch.float32)
    if backbone_from is not None:
        model.base_model.load_state_dict(backbone_from.base_model.state_dict())
    _zero_dropout_modules(model)
    return model.train()


def _meta_model(kind: str, config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        model = _model_class(kind).from_config(_config_for(kind, config), dtype=torch.float32)
    _zero_dropout_modules(model)
    return model


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers left out of the state dict (RoPE inv_freq), keyed by their module path (wrappers included)."""
    persistent = set(model.state_dict().keys())  # names without activation-checkpoint wrappers
    return {name: buf for name, buf in model.named_buffers() if _clean_name(name) not in persistent}


# ---------------------------------------------------------------------------------------------------------------
# Parallelism: one ordered function, one small step each
# ---------------------------------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers: the one whose blocks are the model's `_no_split_modules` classes."""
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            inner = [_unwrap(block) for block in module]
            if all(type(block).__name__ in no_split for block in inner):
                return module
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: no nn.ModuleList of its _no_split_modules "
        f"{sorted(no_split)}; this model architecture is not supported"
    )


def _unwrap(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap each decoder layer in a non-reentrant activation checkpoint: its activations are recomputed in backward."""
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer)


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    reshard_after_forward: bool,
) -> None:
    """fully_shard each decoder layer, then the root (embedding, final norm, head, tied or not, in one unit).

    The root keeps its parameters unsharded after forward (reshard_after_forward=False) whatever the setting for
    the layers, so a loss that runs after the forward can use the output projection's full weight.
    """
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )
    # The root last: fully_shard groups the parameters not already claimed by a layer unit.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy, reshard_after_forward=False)


def parallelize(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    activation_checkpointing: bool,
    cpu_offload: bool,
) -> nn.Module:
    """Apply activation checkpointing and FSDP2 (FSDP on a 1-D mesh, HSDP on a 2-D one) to `model` in place.

    param_dtype: the dtype of the all-gathered parameters used in forward/backward (the sharded master weights
    stay fp32); reduce_dtype: the dtype of the gradient reduce-scatter. cpu_offload keeps sharded parameters,
    gradients and optimizer state on the CPU (pinned memory, so it needs an accelerator to be worth it).
    """
    # Checkpointing before fully_shard: the wrapper must sit inside the layer's FSDP unit.
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    apply_fsdp(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
    )
    return model


# ---------------------------------------------------------------------------------------------------------------
# Sharded models
# ---------------------------------------------------------------------------------------------------------------


def _load_full_weights(
    model: nn.Module,
    *,
    full_state_dict: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    device: torch.device,
) -> None:
    """Fill a parallelized, `to_empty`'d model from rank 0's full state dict and non-persistent buffers."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # set_model_state_dict replaces the values of the dict it is given (platform notes): hand it a copy.
    set_model_state_dict(model, dict(full_state_dict), options=options)
    rank = world.rank()
    for name, buf in _non_persistent_buffers(model).items():
        value = buffers[_clean_name(name)].to(device) if rank == 0 else torch.empty_like(buf, device=device)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast(value, src=0)
        _set_buffer(model, name, value)
    for module in model.modules():  # persistent buffers too, in case to_empty put them on the CPU (offload)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, buffer_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._buffers[buffer_name] = value


def build_sharded_model(
    kind: str,
    *,
    path: str | None,
    config: Mapping[str, Any] | PretrainedConfig | None,
    seed: int,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    backbone_from_path: str | None = None,
    backbone_from_config: Mapping[str, Any] | PretrainedConfig | None = None,
    backbone_seed: int | None = None,
) -> PreTrainedModel:
    """A model of `kind` ("policy", "value", "reference") with FSDP2 applied over `mesh`, weights from rank 0.

    Rank 0 builds the full model with `build_full_model` (from `path`, or from `config` and `seed`); if a backbone
    source is given (a path, or a config with `backbone_seed`), its base model's weights replace this model's base
    model (a value model starting from the policy). All ranks then follow the order in the module docstring.
    Collective: every rank of the default group must call it with the same arguments.
    """
    on_cuda = mesh.device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    resolved = resolve_config(path=path, config=config)
    full_state_dict: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if world.rank() == 0:
        backbone = None
        if backbone_from_path is not None or backbone_from_config is not None:
            backbone = build_full_model(
                "policy",
                path=backbone_from_path,
                config=backbone_from_config,
                seed=seed if backbone_seed is None else backbone_seed,
            )
        full = build_full_model(kind, path=path, config=config, seed=seed, backbone_from=backbone)
        full_state_dict = full.state_dict()
        buffers = _non_persistent_buffers(full)
        del full, backbone
    model = _meta_model(kind, resolved)
    parallelize(
        model,
        mesh=mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
    )
    # Under CPU offload the sharded parameters live on the CPU; FSDP copies them to the device for compute.
    model.to_empty(device="cpu" if cpu_offload else device)
    _load_full_weights(model, full_state_dict=full_state_dict, buffers=buffers, device=device)
    return model.train()


def build_policy(**kwargs: Any) -> PreTrainedModel:
    """The trainable policy (AutoModelForCausalLM); keyword arguments as `build_sharded_model`."""
    return build_sharded_model("policy", **kwargs)


def build_value_model(**kwargs: Any) -> PreTrainedModel:
    """The trainable critic (AutoModelForTokenClassification, num_labels=1); keyword arguments as
    `build_sharded_model`. To start from the policy's weights pass `backbone_from_path` (or `backbone_from_config`
    and `backbone_seed`, the policy's config and seed); the score head then comes from `seed`."""
    return build_sharded_model("value", **kwargs)


def build_reference_model(**kwargs: Any) -> PreTrainedModel:
    """A frozen copy of the initial policy for the KL term: no parameter requires grad, eval mode.

    Keyword arguments as `build_sharded_model` (activation checkpointing makes no sense without backward and is
    refused). Its root keeps the output projection unsharded after a forward like the policy's; call
    `model.reshard()` after the log-prob pass to free it.
    """
    if kwargs.get("activation_checkpointing"):
        raise ValueError("the reference model never runs backward: build it with activation_checkpointing=False")
    model = build_sharded_model("reference", **kwargs)
    model.requires_grad_(False)
    return model.eval()


def output_projection_weight(model: nn.Module) -> torch.Tensor:
    """The full `[vocab, hidden]` weight of the output projection, for a chunked loss run after the model's forward.

    Valid between a root forward and the end of its backward (the root unit does not reshard after forward).
    Raises if the weight is still sharded, i.e. if no forward of the root module ran since the last reshard.
    """
    weight = model.get_output_embeddings().weight
    if isinstance(weight, DTensor):
        raise RuntimeError(
            "the output projection is still sharded: call the root model's forward (e.g. with "
            "output_hidden_states=True, logits_to_keep=1) before reading its weight"
        )
    return weight


# ---------------------------------------------------------------------------------------------------------------
# Size report and gathering (tests, export)
# ---------------------------------------------------------------------------------------------------------------


def _format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def describe_model_memory(model: nn.Module, *, num_shards: int = 1) -> str:
    """One line: parameter count, weight size, largest layer (accelerate's `calculate_maximum_sizes`) and an
    estimate of the training state per rank when sharded `num_shards` ways.

    The estimate counts fp32 weights, fp32 gradients and AdamW's two fp32 moments (16 bytes per parameter) divided
    by `num_shards`, plus one unsharded largest layer (the all-gather); activations are not included.
    Works on a plain, meta or sharded model (DTensor sizes are global).
    """
    total_bytes, (largest_bytes, largest_names) = calculate_maximum_sizes(model)
    num_params = sum(p.numel() for p in model.parameters())
    per_rank = 16 * num_params / num_shards + largest_bytes
    largest = ", ".join(_clean_name(name) for name in largest_names) or "-"
    return (
        f"{type(model).__name__}: {num_params / 1e6:.2f} M parameters, {_format_bytes(total_bytes)} of weights; "
        f"largest layer {largest} ({_format_bytes(largest_bytes)}); training state per rank at {num_shards} "
        f"shard(s) ~{_format_bytes(per_rank)} (fp32 weights, grads, 2 AdamW moments, one gathered layer; "
        f"activations not included)"
    )


def _clean_name(name: str) -> str:
    return name.replace(_CHECKPOINT_WRAPPED, "")


def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on the CPU, names as in the plain HF model. Collective.

    rank0_only=True: rank 0 gets the tensors and other ranks an empty dict (bounded host memory for export).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    return {name: tensor.detach().cpu() for name, tensor in state.items()}


def gather_full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient on the CPU on every rank (None-grad parameters are left out), keyed by the
    plain HF parameter names (tied parameters once). Collective: `DTensor.full_tensor()` all-gathers the shards."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[_clean_name(name)] = grad.detach().cpu()
    return grads
