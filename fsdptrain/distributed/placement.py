"""Generator ranks and trainer ranks in one launch (``rollout.placement=separate``; docs/async.md).

A launch of ``N`` processes with ``rollout.generator_ranks=G`` splits into ``T = N - G`` trainer ranks (global ranks
``0..T-1``) and ``G`` generator ranks (``T..N-1``). Each side gets a default process group of its own, so the trainer
code (FSDP2 meshes, DCP checkpoints, every collective of the step) sees a world of ``T`` ranks and runs unchanged;
the two sides meet only through the :class:`Bridge`'s two process groups, built from the launch's one store:

- ``objects``: gloo over all ``N`` ranks, point to point: a trainer rank's job (the rows of a step) to its generator,
  the generator's samples back. Trainer rank ``r`` is served by generator ``r % G``.
- ``weights``: trainer rank 0 and the ``G`` generators (group rank 0 is the trainer), gloo on the CPU and NCCL on
  GPUs: the policy's weights, broadcast in buckets after each optimizer step.

Both groups time out after ``rollout.generator_timeout_s``: a generator that hangs ends the run instead of holding it.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed

OBJECT_TAG = 0


@dataclass(frozen=True)
class Placement:
    """Where this process sits in a separate-placement launch."""

    trainers: int
    generators: int
    global_rank: int

    @property
    def is_generator(self) -> bool:
        return self.global_rank >= self.trainers

    @property
    def generator_index(self) -> int:
        """This generator's index among the generators (0..G-1)."""
        return self.global_rank - self.trainers

    def generator_of(self, trainer_rank: int) -> int:
        """The global rank of the generator that serves ``trainer_rank``."""
        return self.trainers + trainer_rank % self.generators

    def served_by(self, generator_index: int) -> list[int]:
        """The trainer ranks generator ``generator_index`` serves, in rank order."""
        return [r for r in range(self.trainers) if r % self.generators == generator_index]


class GeneratorFailed(RuntimeError):
    """A generator rank died, hung past ``rollout.generator_timeout_s`` or raised; the message names it."""


class TrainersGone(RuntimeError):
    """A generator lost its trainers (they ended, or failed: they report why)."""


class Bridge:
    """The two process groups between the sides (see the module docstring)."""

    def __init__(self, store: torch.distributed.Store, placement: Placement, *, device: torch.device,
                 timeout_s: float):
        self.placement = placement
        self.device = device
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        total = placement.trainers + placement.generators
        self.objects = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("objects", store),
                                                          placement.global_rank, total, timeout)
        self.weights = None
        weights_rank = 0 if placement.global_rank == 0 else (
            1 + placement.generator_index if placement.is_generator else None)
        if weights_rank is not None:
            weights_store = torch.distributed.PrefixStore("weights", store)
            if device.type == "cuda":
                options = torch.distributed.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.weights = torch.distributed.ProcessGroupNCCL(weights_store, weights_rank,
                                                                  1 + placement.generators, options)
            else:
                self.weights = torch.distributed.ProcessGroupGloo(weights_store, weights_rank,
                                                                  1 + placement.generators, timeout)
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []

    # -- objects, point to point -------------------------------------------------------------------------------------

    def send(self, obj: Any, dst: int, *, tag: int = OBJECT_TAG) -> None:
        """Send ``obj`` (pickled) to global rank ``dst`` without waiting for it to arrive; :meth:`flush` waits.
        Objects of one ``tag`` between two ranks arrive in the order they were sent."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for tensor in (size, payload):
            self._pending.append((self.objects.send([tensor], dst, tag), [tensor]))
        self._pending = [(work, kept) for work, kept in self._pending if not work.is_completed()]

    def recv(self, src: int, *, tag: int = OBJECT_TAG) -> Any:
        """The next object of ``tag`` from global rank ``src`` (blocks at most the bridge's timeout)."""
        size = torch.empty(1, dtype=torch.int64)
        self.objects.recv([size], src, tag).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.objects.recv([payload], src, tag).wait()
        return pickle.loads(payload.numpy().tobytes())

    def flush(self) -> None:
        """Wait until everything :meth:`send` sent has arrived."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    # -- weights, broadcast in buckets -------------------------------------------------------------------------------

    def broadcast(self, buckets: Sequence[torch.Tensor], *, wait: bool) -> list:
        """Broadcast each bucket from trainer rank 0 to every generator (in order); the pending works when not
        ``wait`` (the caller keeps them, and the buckets, until they complete)."""
        works = []
        for bucket in buckets:
            options = torch.distributed.BroadcastOptions()
            options.rootRank = 0
            works.append(self.weights.broadcast([bucket], options))
        if wait:
            for work in works:
                work.wait()
            return []
        return works


def bucket_plan(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of tensors of ``sizes`` bytes grouped into buckets of at most ``bucket_bytes`` each, in order; a
    tensor larger than a bucket goes alone. Both sides compute it from the same sizes, so no plan is sent."""
    plan: list[list[int]] = []
    filled = bucket_bytes
    for index, size in enumerate(sizes):
        if not plan or filled + size > bucket_bytes:
            plan.append([])
            filled = 0
        plan[-1].append(index)
        filled += size
    return plan


_BRIDGE: Optional[Bridge] = None


def set_bridge(bridge: Optional[Bridge]) -> None:
    global _BRIDGE
    _BRIDGE = bridge


def bridge() -> Optional[Bridge]:
    """This process's bridge in a separate-placement launch, else None."""
    return _BRIDGE
