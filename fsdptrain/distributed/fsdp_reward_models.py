"""FSDP2-sharded reward models, and a critic initialised from a reward model (`model.value_init=reward_model`).

A reward model is one more frozen model, built like the reference model in fsdptrain/distributed/fsdp.py and with its
helpers:
rank 0 loads the full fp32 model on the CPU; every rank builds the architecture on the meta device, applies FSDP2
(`fsdp.parallelize`: each decoder layer, then the root), `to_empty`, and receives the weights broadcast from rank 0.
No activation checkpointing (it never runs backward), no gradients, eval mode, and no optimizer.

Memory: `offload=True` applies FSDP2's CPUOffloadPolicy, so the sharded parameters live on the CPU and FSDP copies
each unit to the accelerator for its forward; after a scoring phase `model.reshard()` frees the root unit (which
never reshards after forward), and the reward model then holds no accelerator memory until the next phase.
User-facing description: docs/reward-models.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig, PreTrainedModel

from fsdptrain.config import ConfigError
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import _load_full_weights, keep_masters_in, parallelize
from fsdptrain.model.loading import config_for, meta_model, non_persistent_buffers, resolve_config
from fsdptrain.model.reward_model import HEAD, RewardModelSpec, _meta_reward_model, load_full_reward_model

# Config fields that change a decoder's math without changing a weight's shape: they must agree for the critic to
# reproduce the reward model (the weight shapes are compared separately).
_MATH_FIELDS = ("model_type", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
                "head_dim", "attention_bias", "mlp_bias", "use_sliding_window", "sliding_window")


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_rank0(load: Callable[[], tuple[dict, dict]]) -> tuple[dict, dict]:
    """`load()` on rank 0 (full state dict, non-persistent buffers); empty dicts elsewhere. A ConfigError it raises
    is raised on every rank (one broadcast), so no rank waits for weights that never come."""
    loaded: tuple[dict, dict] = ({}, {})
    message: list[str | None] = [None]
    if world.rank() == 0:
        try:
            loaded = load()
        except ConfigError as err:
            message[0] = str(err)
    if world.world_size() > 1:
        torch.distributed.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise ConfigError(message[0])
    return loaded


def _shard_and_fill(
    model: PreTrainedModel,
    *,
    full_state_dict: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    mesh: DeviceMesh,
    **parallel: Any,
) -> PreTrainedModel:
    """FSDP2 over a meta `model` (`models.parallelize` with `parallel`), then rank 0's full weights broadcast into it:
    models.build_sharded_model's order."""
    keep_masters_in(model, parallel["param_dtype"])
    parallelize(model, mesh=mesh, **parallel)
    device = _device(mesh)
    # Under CPU offload the sharded parameters live on the CPU; FSDP copies them to the device for compute.
    model.to_empty(device="cpu" if parallel["cpu_offload"] else device)
    _load_full_weights(model, full_state_dict=full_state_dict, buffers=buffers, device=device)
    return model


def build_reward_model(
    spec: RewardModelSpec,
    *,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> PreTrainedModel:
    """The reward model of `spec`, FSDP2-sharded over `mesh`, frozen (no parameter requires grad), eval mode.

    `param_dtype`: the dtype of the gathered parameters in forward (shards stay fp32). `offload`: shards on the CPU
    between (and during) forwards, see the module docstring. Switch it to the policy's packed attention backend
    before scoring (`attention_switch.set_attention`). Collective: every rank of the default group calls it alike.
    """

    def load():
        full = load_full_reward_model(spec)
        return full.state_dict(), non_persistent_buffers(full)

    full_state_dict, buffers = _on_rank0(load)
    model = _shard_and_fill(_meta_reward_model(spec.config), full_state_dict=full_state_dict, buffers=buffers,
                            mesh=mesh, param_dtype=param_dtype, reduce_dtype=torch.float32,
                            reshard_after_forward=reshard_after_forward, activation_checkpointing=False,
                            cpu_offload=offload)
    model.requires_grad_(False)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# The critic from a reward model
# ---------------------------------------------------------------------------------------------------------------


def _describe(config: PretrainedConfig) -> str:
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    return (f"{arch} ({config.model_type}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
            f"vocab {config.vocab_size})")


def value_state_dict_from_reward_model(
    reward_state_dict: Mapping[str, torch.Tensor],
    *,
    reward_config: PretrainedConfig,
    value_config: PretrainedConfig,
    reward_path: str,
) -> dict[str, torch.Tensor]:
    """The value model's full state dict (backbone + value head) taken from the reward model's weights.

    `value_config`: the critic's config (the policy's, one label, as models.build_value_model builds it). The
    backbone is copied as is and the value head is the score head (`score.weight`; the value head's bias, which
    the reward head lacks, is 0), so the critic's value at a sequence's last token is the reward model's score.
    Raises ConfigError naming both architectures when the math fields or any weight's shape differ.
    """
    mismatch = [f for f in _MATH_FIELDS if getattr(reward_config, f, None) != getattr(value_config, f, None)]
    expected = meta_model("value", value_config).state_dict()
    out = {name: tensor for name, tensor in reward_state_dict.items() if name in expected}
    bias = f"{HEAD}.bias"
    if bias in expected and bias not in out:
        out[bias] = torch.zeros(expected[bias].shape, dtype=torch.float32)
    missing = sorted(set(expected) - set(out))
    shapes = sorted(n for n in out if out[n].shape != expected[n].shape)
    if mismatch or missing or shapes:
        what = (f"config fields {mismatch}" if mismatch else
                f"missing weights {missing[:3]}" if missing else f"weight shapes of {shapes[:3]}")
        raise ConfigError(
            f"model.value_init=reward_model: the reward model {reward_path!r}, {_describe(reward_config)}, does not "
            f"match the policy's critic, {_describe(value_config)} ({what} differ); use model.value_init=policy"
        )
    return out


def check_same_vocabulary(spec: RewardModelSpec, policy_tokenizer: Any) -> None:
    """ConfigError unless the reward model's tokenizer maps every token as the policy's does: a critic reads the
    policy's token ids, so embeddings learnt for another vocabulary would be read at the wrong rows."""
    if spec.tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise ConfigError(
            f"model.value_init=reward_model: the reward model {spec.path!r} has its own tokenizer, different from "
            f"the policy's; a critic reads the policy's token ids, so start it from model.value_init=policy"
        )


def build_value_model_from_reward_model(
    spec: RewardModelSpec,
    *,
    policy_tokenizer: Any,
    path: str | None,
    config: Mapping[str, Any] | PretrainedConfig | None,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
) -> PreTrainedModel:
    """The trainable critic (token classification, one label) with backbone and head from the reward model.

    `path` / `config`: the policy's source, as for models.build_value_model. Checks run on every rank before any
    weight moves (vocabulary, then rank 0's architecture check reaches the others through the broadcast of a flag).
    Collective.
    """
    check_same_vocabulary(spec, policy_tokenizer)
    value_config = config_for("value", resolve_config(path=path, config=config))

    def load():
        full = load_full_reward_model(spec)
        state = value_state_dict_from_reward_model(full.state_dict(), reward_config=spec.config,
                                                   value_config=value_config, reward_path=spec.path)
        return state, non_persistent_buffers(full)

    full_state_dict, buffers = _on_rank0(load)
    model = _shard_and_fill(meta_model("value", value_config), full_state_dict=full_state_dict, buffers=buffers,
                            mesh=mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                            reshard_after_forward=reshard_after_forward,
                            activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload)
    return model.train()
