"""The policy's weights from the trainer ranks' FSDP2 shards to the generator ranks' unsharded copies
(``rollout.placement=separate``; docs/async.md, "Weights").

A version goes over as one header (names, shapes, dtypes, on the bridge's object group from trainer rank 0 to each
generator) and the tensors' bytes concatenated into buckets of at most ``rollout.weight_bucket_mb`` MiB, broadcast
from trainer rank 0 over the bridge's weights group (gloo on the CPU, NCCL on GPUs). Floating tensors travel in the
param dtype (``parallel.param_dtype``), the dtype the generators hold the policy in.

What a version holds: the first one a run sends, every entry of the policy's state dict (the generators start from
exactly the trainer's weights, however the run began); every later one, the trainable parameters only
(`fsdptrain.model.loading.trainable_parameters`: under LoRA the adapters, so a LoRA run sends the adapters alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from fsdptrain.distributed import world
from fsdptrain.distributed.placement import Bridge, bucket_plan
from fsdptrain.model.loading import clean_name, trainable_parameters

HEADER_TAG = 1
"""The object tag of a version's header (jobs and samples use the bridge's tag 0)."""


@dataclass(frozen=True)
class Sent:
    """What one :meth:`WeightSender.send` did (trainer rank 0's numbers; 0 bytes on the other trainer ranks)."""

    version: int
    seconds: float
    bytes: int


class WeightSender:
    """The trainer side: :meth:`send` gathers a version from the shards (collective over the trainer ranks) and
    trainer rank 0 broadcasts it without waiting for the generators to take it (they take it when a step they
    generate needs it); the previous version's broadcast is waited for first."""

    def __init__(self, model: nn.Module, bridge: Bridge, *, param_dtype: torch.dtype, bucket_bytes: int):
        self.model, self.bridge = model, bridge
        self.param_dtype, self.bucket_bytes = param_dtype, bucket_bytes
        self._in_flight: list = []
        self._kept: list[torch.Tensor] = []

    def send(self, version: int, *, full: bool) -> Sent:
        """Gather and broadcast ``version`` (every state-dict entry when ``full``, else the trainable parameters)."""
        began = time.perf_counter()
        tensors = self._gather(full)
        sent_bytes = 0
        if world.rank() == 0:
            self.wait()
            names = list(tensors)
            cast = [self._cast(tensors[name]) for name in names]
            header = {"version": version, "names": names, "shapes": [tuple(t.shape) for t in cast],
                      "dtypes": [str(t.dtype).removeprefix("torch.") for t in cast]}
            for generator in range(self.bridge.placement.generators):
                self.bridge.send(header, self.bridge.placement.trainers + generator, tag=HEADER_TAG)
            flat = [t.contiguous().view(-1).view(torch.uint8) for t in cast]
            plan = bucket_plan([f.numel() for f in flat], self.bucket_bytes)
            device = self.bridge.device
            buckets = [torch.cat([flat[i] for i in indices]).to(device) for indices in plan]
            self._kept = buckets
            self._in_flight = self.bridge.broadcast(buckets, wait=False)
            sent_bytes = sum(f.numel() for f in flat)
        return Sent(version=version, seconds=time.perf_counter() - began, bytes=sent_bytes)

    def wait(self) -> None:
        """Wait until the generators have taken the version in flight (trainer rank 0)."""
        for work in self._in_flight:
            work.wait()
        self._in_flight, self._kept = [], []

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.param_dtype) if tensor.is_floating_point() else tensor

    def _gather(self, full: bool) -> dict[str, torch.Tensor]:
        """The version's tensors on trainer rank 0 (an empty dict elsewhere). Collective over the trainer ranks."""
        if full:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return {name: t.detach() for name, t in get_model_state_dict(self.model, options=options).items()}
        trainable = {id(p) for p in trainable_parameters(self.model)}
        gathered = {}
        for name, param in self.model.named_parameters():
            if id(param) not in trainable:
                continue
            full_param = param.full_tensor() if isinstance(param, DTensor) else param
            if world.rank() == 0:
                gathered[clean_name(name)] = full_param.detach().cpu()
        return gathered


class WeightReceiver:
    """The generator side: :meth:`receive` takes the next version into the generator's unsharded policy (called
    between decode steps, never in the middle of one)."""

    def __init__(self, model: nn.Module, bridge: Bridge, *, bucket_bytes: int):
        self.model, self.bridge, self.bucket_bytes = model, bridge, bucket_bytes
        self.version: Optional[int] = None
        self.received_bytes = 0

    def receive(self) -> int:
        """Receive the next version, copy it into the model, return its number."""
        header = self.bridge.recv(0, tag=HEADER_TAG)
        dtypes = [getattr(torch, name) for name in header["dtypes"]]
        sizes = [_numel(shape) * torch.empty((), dtype=dtype).element_size()
                 for shape, dtype in zip(header["shapes"], dtypes)]
        plan = bucket_plan(sizes, self.bucket_bytes)
        device = self.bridge.device
        buckets = [torch.empty(sum(sizes[i] for i in indices), dtype=torch.uint8, device=device) for indices in plan]
        self.bridge.broadcast(buckets, wait=True)
        targets = self.model.state_dict()
        with torch.no_grad():
            for indices, bucket in zip(plan, buckets):
                offset = 0
                for i in indices:
                    name, shape, dtype = header["names"][i], header["shapes"][i], dtypes[i]
                    value = bucket[offset: offset + sizes[i]].view(dtype).view(shape)
                    offset += sizes[i]
                    if name not in targets:
                        raise RuntimeError(f"the trainer sent {name!r}, which the generator's policy does not have")
                    targets[name].copy_(value)
        self.version = header["version"]
        self.received_bytes = sum(sizes)
        return self.version


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
