"""Expert parallelism (``parallel.ep``): the experts of each MoE layer split over ``ep`` ranks, tokens sent to their
experts' owner all-to-all and their outputs sent back (docs/moe.md, "Expert parallelism").

The mesh (``fsdptrain.distributed.world.build_expert_mesh``): the data-parallel ranks split as
``(dp / ep, ep)``, dims ``("dp_shard_mod_ep", "ep")``; an EP group is ``ep`` consecutive ranks, as in torchtitan.
EP ranks are data-parallel ranks: each still trains on its own rows; only the experts' weights are divided.

What changes, in the ``experts`` module of every sparse block (`fsdptrain.model.moe.moe_layers`) and nowhere else:

- its ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` become DTensors ``(Replicate(), Shard(0))``
  on the expert mesh: EP rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)``. With dp > ep the ``dp / ep`` ranks
  holding the same experts (an EP replica group) shard them further with FSDP2 (``fully_shard`` over
  ``dp_shard_mod_ep``, one unit per experts module, its own unit so the layer's unit does not take them);
- its forward (:func:`dispatching_forward`): the router has already chosen (routing, replay and the aux loss see
  the same routes whatever ``ep``); each (token, expert) pair's hidden row goes to the expert's owner
  (``all_to_all_single`` with the per-rank counts as splits, exchanged first), the owner runs transformers' own
  experts implementation on its experts (``grouped_mm`` or the eager loop, on the rows of each expert in turn), the
  outputs come back by the reverse all-to-all and are weighted and summed over the top-k as transformers does. The
  all-to-alls are differentiable (a small autograd function whose backward is the reverse all-to-all), so the gradient of each token's expert output returns to the owner and the router's gate
  weights train on the token's own rank.

The gradient (docs/loss.md): every rank's loss carries the factor dp_size so that FSDP2's mean over the dp ranks is
the gradient of the global loss. An owner's expert gradient after the backward all-to-all already sums the
contributions of the tokens of its whole EP group; the replica groups then sum theirs, so the one right divisor is
dp_size, not the size of the group that reduces: :func:`apply_expert_parallel` sets it
(``set_gradient_divide_factor``). ``ep=2`` then equals ``ep=1`` up to the order of fp32 sums
(tests/dist/test_expert_parallel.py).

Generation holds the experts whole (:func:`experts_gathered`): decoding runs each rank's own number of forwards, which
a dispatching forward (a collective per layer) cannot; the gathered experts cost E/ep x (ep - 1) experts' weights
per layer per rank for the block.

Left out, and refused in one line (`fsdptrain/config/validate.py`): HSDP (``parallel.dp_replicate > 1``), context
parallelism, LoRA, ``rollout.placement=separate``, ``parallel.compile``, CPU offload. Only the policy is
expert-parallel; a frozen reference and a critic keep their experts whole under FSDP2. No capacity factor, no token
dropping: every (token, expert) pair is computed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MethodType
from typing import Any

import torch
import torch.distributed
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdptrain.config import ConfigError
from fsdptrain.distributed.world import EP, EP_REPLICA
from fsdptrain.model.moe import MoeLayer, moe_layers

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def check_expert_parallel(model: nn.Module, ep: int) -> list[MoeLayer]:
    """The sparse blocks ``parallel.ep`` splits; a ConfigError when the model has none or an E that ``ep`` does not
    divide."""
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model; {type(model).__name__} has no sparse "
                          f"block: set parallel.ep=1 (docs/moe.md)")
    for layer in layers:
        if layer.num_experts % ep:
            raise ConfigError(f"parallel.ep={ep} must divide the {layer.num_experts} experts of {layer.name}: choose "
                              f"an ep that divides {layer.num_experts} (docs/moe.md)")
        held = sorted(name for name, _ in layer.experts.named_parameters())
        if held != sorted(EXPERT_WEIGHTS):
            raise ConfigError(f"parallel.ep={ep} splits experts whose weights are {' and '.join(EXPERT_WEIGHTS)} "
                              f"[E, ...]; {type(layer.experts).__name__} holds {', '.join(held)}: set parallel.ep=1 "
                              f"(docs/moe.md)")
    return layers


def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh, dp_size: int, mp_policy: MixedPrecisionPolicy,
                          offload_policy: OffloadPolicy, reshard_after_forward: bool) -> None:
    """Split every experts module's weights over ``ep_mesh``'s "ep" dim, shard them over its replica dim with FSDP2
    (one unit each, gradients divided by ``dp_size``: see the module docstring) and make its forward dispatch.

    Call before the decoder layers' ``fully_shard`` (`fsdptrain/distributed/fsdp.py` ``parallelize``), on a model
    whose parameters may still be on the meta device."""
    layers = check_expert_parallel(model, ep_mesh[EP].size())
    for layer in layers:
        _split_weights(layer.experts, ep_mesh)
        layer.experts.forward = MethodType(dispatching_forward, layer.experts)
        layer.experts._ep_mesh = ep_mesh
        fully_shard(layer.experts, mesh=ep_mesh, dp_mesh_dims=DataParallelMeshDims(shard=EP_REPLICA),
                    mp_policy=mp_policy, offload_policy=offload_policy, reshard_after_forward=reshard_after_forward)
        layer.experts.set_gradient_divide_factor(float(dp_size))
        if ep_mesh[EP_REPLICA].size() > 1:
            # a SUM then a division: gloo has no PREMUL_SUM. Not on one rank: FSDP2 (torch 2.13) would divide twice
            layer.experts.set_force_sum_reduction_for_comms(True)


def _split_weights(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace each expert weight ``[E, ...]`` by a DTensor of this EP rank's ``[E / ep, ...]`` rows, replicated over
    the replica dim (FSDP2 shards that one). No communication: meta tensors stay meta until ``to_empty``, and the
    values arrive with the model's full state dict."""
    ep, rank = ep_mesh[EP].size(), ep_mesh[EP].get_local_rank()
    for name in EXPERT_WEIGHTS:
        param = getattr(experts, name)
        local = param.detach().chunk(ep, dim=0)[rank].clone()
        weight = DTensor.from_local(local, ep_mesh, (Replicate(), Shard(0)), run_check=False, shape=param.shape,
                                    stride=param.stride())
        experts.register_parameter(name, nn.Parameter(weight, requires_grad=param.requires_grad))


def is_expert_parallel(model: nn.Module) -> bool:
    """Whether ``model``'s experts are split by :func:`apply_expert_parallel`."""
    return any(hasattr(layer.experts, "_ep_mesh") for layer in moe_layers(model))


class _ExpertsView:
    """What transformers' experts implementations read of the module (``self.num_experts``, ``self.gate_up_proj``,
    ``self.down_proj``, its config, activation and flags), with the weights and the expert count given: this rank's
    experts, or all of them gathered. Everything else is the module's own."""

    def __init__(self, experts: nn.Module, gate_up_proj: Tensor, down_proj: Tensor):
        self.__dict__.update(_experts=experts, gate_up_proj=gate_up_proj, down_proj=down_proj,
                             num_experts=gate_up_proj.shape[0])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_experts"], name)


def _implementation(experts: nn.Module, gate_up_proj: Tensor, down_proj: Tensor, hidden: Tensor, index: Tensor,
                    weights: Tensor) -> Tensor:
    """The experts module's own transformers forward (its class's, decorated with ``use_experts_implementation``) on
    the given weights."""
    return type(experts).forward(_ExpertsView(experts, gate_up_proj, down_proj), hidden, index, weights)


def _local(weight: Tensor) -> Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def dispatching_forward(self: nn.Module, hidden_TH: Tensor, top_k_index_Tk: Tensor, top_k_weights_Tk: Tensor) -> Tensor:
    """The experts' forward under expert parallelism, bound to the experts module; the same contract as the module's
    own (``[T, H]`` rows, ``[T, k]`` chosen experts and gate weights, ``[T, H]`` out). Collective over the EP group
    unless the experts are gathered (:func:`experts_gathered`).

    Legend: T tokens here, k top-k, S = T k (token, expert) pairs sent, R pairs received, E experts, e = E / ep."""
    gathered = self.__dict__.get("_ep_gathered")
    if gathered is not None:
        return _implementation(self, *gathered, hidden_TH, top_k_index_Tk, top_k_weights_Tk)
    group = self._ep_mesh.get_group(EP)
    ep, num_experts = self._ep_mesh[EP].size(), self.num_experts
    local_experts = num_experts // ep
    num_tokens, top_k = top_k_index_Tk.shape
    expert_S = top_k_index_Tk.reshape(-1)
    _, perm_S = torch.sort(expert_S, stable=True)  # grouped by expert, hence by owner
    rows_SH = hidden_TH[perm_S // top_k]
    with torch.no_grad():
        sent_E = torch.bincount(expert_S, minlength=num_experts).to(torch.int64)
        received_Pe = torch.empty_like(sent_E)  # [ep * e]: from each source rank, its count for each of our experts
        torch.distributed.all_to_all_single(received_Pe, sent_E, group=group)
        received_Pe = received_Pe.view(ep, local_experts)
    send_splits = sent_E.view(ep, local_experts).sum(dim=1).tolist()
    recv_splits = received_Pe.sum(dim=1).tolist()
    received_RH = _all_to_all(rows_SH, recv_splits, send_splits, group)
    # rank-major (source, expert) blocks -> expert-major, so each of our experts sees its rows together
    expert_R = torch.arange(local_experts, device=hidden_TH.device).repeat(ep).repeat_interleave(
        received_Pe.reshape(-1).to(hidden_TH.device))
    _, order_R = torch.sort(expert_R, stable=True)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    out_RH = _implementation(self, gate_up, down, received_RH[order_R], expert_R[order_R].unsqueeze(-1),
                             received_RH.new_ones(len(expert_R), 1))
    if not len(expert_R) and torch.is_grad_enabled():
        # nothing received: transformers' eager loop then returns zeros outside the graph, and this rank would skip
        # the backward all-to-alls its peers wait in (and leave its experts without a gradient for FSDP2 to reduce)
        out_RH = _Attached.apply(out_RH, received_RH, gate_up, down)
    out_RH = out_RH[torch.argsort(order_R)]
    back_SH = _all_to_all(out_RH, send_splits, recv_splits, group)
    # transformers' own combine (integrations/moe.py grouped_mm_experts_forward): weight, restore order, sum over k
    weighted_SH = back_SH * top_k_weights_Tk.reshape(-1)[perm_S].unsqueeze(-1)
    weighted_SH = weighted_SH[torch.argsort(perm_S)]
    return weighted_SH.view(num_tokens, top_k, hidden_TH.shape[-1]).sum(dim=1).to(hidden_TH.dtype)


def _exchange(rows: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    torch.distributed.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits whose backward is the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, rows: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


class _Attached(torch.autograd.Function):
    """``value`` unchanged, made to depend on ``inputs`` in the graph, which receive zero gradients: the backward then
    reaches every node that the value's peers on other ranks reach."""

    @staticmethod
    def forward(ctx, value: Tensor, *inputs: Tensor) -> Tensor:
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in inputs]
        return value.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes)


def _all_to_all(rows: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    """Rows ``input_splits[r]`` at a time to rank r of ``group``, ``output_splits[r]`` rows received from it;
    differentiable (the backward sends each row's gradient back to where the row came from)."""
    return _AllToAll.apply(rows, output_splits, input_splits, group)


@contextlib.contextmanager
def experts_gathered(model: nn.Module, *, reshard_after_forward: bool) -> Iterator[None]:
    """Every experts module of an expert-parallel ``model`` holds all E experts for the block (collective: each
    experts unit is unsharded and held so, then all-gathered over its EP group), so its forwards run without dispatch
    and without a collective, exactly as ``ep=1``'s; on exit the units are resharded and get back
    ``reshard_after_forward`` (the configured setting). No-op for other models. For no-grad forwards only."""
    units = [layer.experts for layer in moe_layers(model) if hasattr(layer.experts, "_ep_mesh")]
    if not units:
        yield
        return
    for experts in units:
        assert isinstance(experts, FSDPModule)
        experts.set_reshard_after_forward(False, recurse=False)
        experts.unshard()
        with torch.no_grad():
            experts.__dict__["_ep_gathered"] = tuple(_gathered(getattr(experts, name)) for name in EXPERT_WEIGHTS)
    try:
        yield
    finally:
        for experts in units:
            experts.__dict__.pop("_ep_gathered", None)
            experts.reshard()
            experts.set_reshard_after_forward(reshard_after_forward, recurse=False)


def _gathered(weight: Tensor) -> Tensor:
    """All E experts' weights of an unsharded experts unit (an all-gather over the EP group)."""
    return weight.full_tensor() if isinstance(weight, DTensor) else weight
