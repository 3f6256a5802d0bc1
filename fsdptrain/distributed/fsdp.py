"""Hugging Face policy, value and reference models, sharded with FSDP2.

fsdptrain/model/loading.py builds the models; this module applies parallelism to them, in this order:

    rank 0: the full fp32 model on the CPU (from `path`, or from a config and the seed) -> its state dict
    every rank: the same architecture on the meta device -> parallelize (activation checkpointing, then
    fully_shard per decoder layer, then the root) -> to_empty -> set_model_state_dict(full, broadcast from rank 0)
    -> non-persistent buffers (RoPE inv_freq) broadcast from rank 0

Random initialisation happens once, on rank 0's CPU, so the weights are the same at any world size; a sharded model
never draws random numbers (DTensor random init on a CPU mesh differs from a single-process init).

The root FSDP unit (embedding, final norm, output head; one unit, so tied embeddings stay tied) never reshards after
forward. A chunked loss that runs after the forward can therefore read `model.get_output_embeddings().weight` as a
plain, unsharded tensor (see `output_projection_weight`); its gradient accumulates into that unsharded parameter and is
reduce-scattered with the rest of the root unit when backward finishes.

"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
)

from fsdptrain.distributed import world
from fsdptrain.distributed.expert_parallel import apply_expert_parallel
from fsdptrain.model.loading import (
    build_full_model,
    clean_name,
    decoder_layers,
    meta_model,
    non_persistent_buffers,
    resolve_config,
    trainable_parameters,
    use_experts_for,
)
from fsdptrain.model.lora import LoraSettings, set_adapters_enabled

# The embedded default: a tiny Llama that trains in seconds on a CPU.


# ---------------------------------------------------------------------------------------------------------------
# Configs and full (unsharded) models on the CPU
# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# Parallelism: one ordered function, one small step each
# ---------------------------------------------------------------------------------------------------------------


def _attention_configs(model: nn.Module) -> list[PretrainedConfig]:
    """The configs whose ``_attn_implementation`` the layers of ``model`` read at call time (one per sub-model)."""
    configs: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            configs.setdefault(id(module.config), module.config)
    return list(configs.values())


@contextlib.contextmanager
def _attention_as_of(configs: list[PretrainedConfig], implementations: list[Any]) -> Iterator[None]:
    """Set each config's attention implementation to the one recorded with it, then restore the current ones."""
    current = [config._attn_implementation_internal for config in configs]
    for config, implementation in zip(configs, implementations):
        config._attn_implementation_internal = implementation
    try:
        yield
    finally:
        for config, implementation in zip(configs, current):
            config._attn_implementation_internal = implementation


@contextlib.contextmanager
def _function_modes_as_of(modes: list[TorchFunctionMode]) -> Iterator[None]:
    """Enter each of ``modes`` that is not active now, outermost first (the recorded stack of a forward)."""
    active = {id(mode) for mode in _get_current_function_mode_stack()}
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap each decoder layer in a non-reentrant activation checkpoint: its activations are recomputed in backward.

    The recomputation runs under the attention implementation and the torch function modes the layer's forward ran
    under. The implementation is model state that a context manager switches for the duration of a forward
    (``generation_attention``, ``packed_attention`` in fsdptrain/model/attention_switch.py); a backward that runs
    after the block has exited would otherwise recompute on another backend than the forward's: a padded batch's mask
    reaches a packed backend (which refuses it), or a packed row reaches sdpa (which attends across its sequences:
    silently wrong gradients). A function mode (check-metrics' float64 mode, fsdptrain/check/precision.py) is not
    active where torch recomputes, so a layer would recompute in another dtype than its forward and torch refuses it.
    """
    configs = _attention_configs(model)

    def forward_and_recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        # called by torch.utils.checkpoint when the layer's forward runs: record the implementations and modes then
        recorded = [config._attn_implementation_internal for config in configs]
        modes = list(_get_current_function_mode_stack())

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with _attention_as_of(configs, recorded), _function_modes_as_of(modes):
                yield

        return contextlib.nullcontext(), recompute()

    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer, context_fn=forward_and_recompute_contexts)


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    """torch.compile each decoder layer in place (``nn.Module.compile``: names and types unchanged) with ``backend``;
    packed rows change length every step, so shapes are dynamic."""
    for layer in decoder_layers(model):
        layer.compile(backend=backend, dynamic=True)


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
    compile: bool = False,
    compile_backend: str = "inductor",
    ep: int = 1,
) -> nn.Module:
    """Apply activation checkpointing, expert parallelism (``ep`` > 1) and FSDP2 (FSDP on a 1-D mesh, HSDP on a 2-D one) to `model` in place.

    param_dtype: the dtype of the all-gathered parameters used in forward/backward (the sharded master weights
    stay fp32); reduce_dtype: the dtype of the gradient reduce-scatter. cpu_offload keeps sharded parameters,
    gradients and optimizer state on the CPU (pinned memory, so it needs an accelerator to be worth it). compile:
    torch.compile each decoder layer in place (torchtitan's way) with ``compile_backend``; generation runs them eagerly
    (see `generation` in fsdptrain/generation/block.py). ``ep``: the experts of a mixture-of-experts model split over
    that many of the mesh's ranks (fsdptrain/distributed/expert_parallel.py).
    """
    # Checkpointing before fully_shard: the wrapper must sit inside the layer's FSDP unit.
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    # Compile per layer, before fully_shard (torchtitan's order); FSDP2's hooks are dynamo-disabled, so they run eagerly.
    if compile:
        apply_compile(model, backend=compile_backend)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    # Experts before the layers: a layer's fully_shard takes every parameter not already in a unit of its own.
    if ep > 1:
        apply_expert_parallel(model, ep_mesh=world.build_expert_mesh(ep=ep, device_type=mesh.device_type),
                              dp_size=world.dp_size(mesh), mp_policy=mp_policy, offload_policy=offload_policy,
                              reshard_after_forward=reshard_after_forward)
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
    # set_model_state_dict replaces the values of the dict it is given (torch 2.13): hand it a copy.
    set_model_state_dict(model, dict(full_state_dict), options=options)
    rank = world.rank()
    for name, buf in non_persistent_buffers(model).items():
        # in the model's dtype on every rank: the broadcast must send what the other ranks receive into (a float64
        # model's rotary frequencies are float64, rank 0's full model's float32)
        value = (buffers[clean_name(name)].to(device=device, dtype=buf.dtype) if rank == 0
                 else torch.empty_like(buf, device=device))
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
    compile: bool = False,
    compile_backend: str = "inductor",
    backbone_from_path: str | None = None,
    backbone_from_config: Mapping[str, Any] | PretrainedConfig | None = None,
    backbone_seed: int | None = None,
    lora: LoraSettings | None = None,
    ep: int = 1,
) -> PreTrainedModel:
    """A model of `kind` ("policy", "value", "reference") with FSDP2 applied over `mesh`, weights from rank 0.

    Rank 0 builds the full model with `build_full_model` (from `path`, or from `config` and `seed`); if a backbone
    source is given (a path, or a config with `backbone_seed`), its base model's weights replace this model's base
    model (a value model starting from the policy). `lora`: LoRA adapters injected before sharding (rank 0 draws
    them with the weights; FSDP2 shards frozen and trainable parameters in the same units and reduce-scatters the
    gradients of the trainable ones only). `ep` > 1: expert parallelism (`parallelize`). All ranks then follow the order in the module docstring. Collective: every rank of the default group must call it with the same arguments.
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
        full = build_full_model(kind, path=path, config=config, seed=seed, backbone_from=backbone, lora=lora)
        full_state_dict = full.state_dict()
        buffers = non_persistent_buffers(full)
        del full, backbone
    model = meta_model(kind, resolved, lora=lora)
    keep_masters_in(model, param_dtype)
    if kind == "reference":
        model.requires_grad_(False)
    store_frozen_in(model, param_dtype)  # the LoRA base weights, the whole reference; no-op for what trains
    parallelize(
        model,
        mesh=mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
        compile=compile,
        compile_backend=compile_backend,
        ep=ep,
    )
    # Under CPU offload the sharded parameters live on the CPU; FSDP copies them to the device for compute.
    model.to_empty(device="cpu" if cpu_offload else device)
    _load_full_weights(model, full_state_dict=full_state_dict, buffers=buffers, device=device)
    return model.train()


def keep_masters_in(model: nn.Module, dtype: torch.dtype) -> None:
    """float64 compute (check-metrics' float64 mode, fsdptrain/check/precision.py) keeps float64 master weights
    too: FSDP2 casts the reduced gradient to the sharded parameter's dtype, so float32 masters would round every
    gradient to float32. Any other dtype keeps float32 masters."""
    if dtype == torch.float64:
        model.to(torch.float64)
        use_experts_for(model, dtype)


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen parameters in ``dtype`` (the mixed-precision param dtype) instead of fp32: they take no
    optimizer step, so they need no fp32 master copy, and forwards compute in ``dtype`` anyway (FSDP2 would cast
    the fp32 shard to ``dtype`` before the all-gather: the gathered values are the same). Under LoRA with bf16
    params the base weights then cost 2 bytes each per shard, and so does every weight of the KL reference. FSDP2
    asks a uniform dtype of the trainable parameters of a unit only. Tied parameters stay tied (one replacement per
    parameter)."""
    if dtype == torch.float32:
        return
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or param.dtype == dtype:
                continue
            if id(param) not in replaced:  # the old parameter is kept referenced, so its id is never reused
                replaced[id(param)] = (param, nn.Parameter(param.detach().to(dtype), requires_grad=False))
            module._parameters[name] = replaced[id(param)][1]


def build_policy(**kwargs: Any) -> PreTrainedModel:
    """The trainable policy (AutoModelForCausalLM); keyword arguments as `build_sharded_model`."""
    return build_sharded_model("policy", **kwargs)


def build_value_model(**kwargs: Any) -> PreTrainedModel:
    """The trainable critic (AutoModelForTokenClassification, num_labels=1); keyword arguments as
    `build_sharded_model`. To start from the policy's weights pass `backbone_from_path` (or `backbone_from_config`
    and `backbone_seed`, the policy's config and seed); the score head then comes from `seed`."""
    return build_sharded_model("value", **kwargs)


def build_reference_model(**kwargs: Any) -> PreTrainedModel:
    """A frozen copy of the initial policy for the KL term: no parameter requires grad, eval mode, the weights stored
    in ``param_dtype`` (`store_frozen_in`: 2 bytes each per shard with bf16 params).

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


def shard_as_one_unit(module: nn.Module, *, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
    """fully_shard a small module (the co-trained drafter) as ONE unit with the policy's mixed precision, in place.

    It must hold the same weights on every rank (built from the same seed); each rank keeps its shard. The unit
    never reshards after forward, so a loss run after its forward can read a weight (the draft head) unsharded.
    """
    module.to(device)
    keep_masters_in(module, param_dtype)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return module


def gather_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`weight[rows]` of a (possibly sharded) parameter, detached, on every rank. Collective for a DTensor."""
    full = weight.full_tensor() if isinstance(weight, DTensor) else weight
    return full.detach()[rows.to(full.device)].clone()


# ---------------------------------------------------------------------------------------------------------------
# Size report and gathering (tests, export)
# ---------------------------------------------------------------------------------------------------------------


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
    trainable = {id(param) for param in trainable_parameters(model)}
    for name, param in model.named_parameters():
        if id(param) not in trainable or param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[clean_name(name)] = grad.detach().cpu()
    return grads


def held_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as this rank holds it, never gathered: the sharded ``DTensor`` of an FSDP2 model
    (the whole tensor on one process or for an unsharded module), keyed like :func:`gather_full_grads`. Not a copy:
    the entries stay valid once the model's gradients are set to None (a new backward makes new tensors), not across
    an in-place change such as a clip. What check-metrics compares gradients by, with collective statistics
    (fsdptrain/check/layouts.py): a gathered float64 gradient costs the whole model's size on every rank."""
    trainable = {id(param) for param in trainable_parameters(model)}
    return {clean_name(name): param.grad.detach() for name, param in model.named_parameters()
            if id(param) in trainable and param.grad is not None}


def zero_grads(model: nn.Module) -> None:
    """Set every gradient of ``model`` to None, the sharded ones of an FSDP2 model included.

    The trap this avoids: FSDP2's root unit never reshards after a forward, so after a no-grad forward (generation,
    an old-log-prob pass, an oracle's teacher forward) `model.parameters()` yields the root's UNSHARDED tensors, and
    `model.zero_grad()` clears those while the sharded gradients of the embedding, the final norm and the head stay:
    the next backward adds to them (measured: the root's gradient exactly doubled). Resharding every unit first makes
    `parameters()` the sharded parameters again. Optimizers hold the sharded parameters, so `optimizer.zero_grad`
    never had the trap; this is for code that zeroes through the module (check-metrics, tests).
    """
    reshard_all(model)
    model.zero_grad(set_to_none=True)


def reset_after_error(model: nn.Module) -> None:
    """Put an FSDP2 model back to a clean iteration state after a forward or backward raised midway, and drop every
    gradient (the failed iteration's are partial); a plain module only loses its gradients.

    Without it the root's end-of-backward callback, which a raised backward never ran, is never queued again: later
    backwards leave the root unit's gradients unreduced on its unsharded parameters (plain tensors beside the
    sharded DTensor gradients) and add to the stale ones (``FSDPModule.reset_iter_state``)."""
    if isinstance(model, FSDPModule):
        model.zero_grad(set_to_none=True)  # the unsharded parameters' partial gradients, while they are registered
        model.reset_iter_state()
    zero_grads(model)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The block's forwards run ``model`` without its LoRA adapters: the base model, i.e. the reference policy
    under LoRA, with no second copy of the weights (docs/lora.md). For no-grad forwards only.

    peft's switch also flips the adapters' ``requires_grad``; FSDP2 copies that flag from the sharded parameter to
    the unsharded one at each all-gather, so the flag is flipped on the sharded parameters: every unit is resharded
    before the switch and again before switching back (the root never reshards after a forward by itself).
    """
    reshard_all(model)
    set_adapters_enabled(model, False)
    try:
        yield
    finally:
        reshard_all(model)
        set_adapters_enabled(model, True)


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of ``model`` (`FSDPModule.reshard` is not recursive); a plain module is left as is.

    Call it after no-grad forwards: the root unit never reshards after a forward, nor do layers built with
    `parallel.reshard_after_forward=false`, so their unsharded weights would stay allocated and be what
    `parameters()` yields."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()

