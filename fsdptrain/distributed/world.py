"""Process group, device mesh and the few collectives the trainer needs.

Every run has a process group, even a single process started without torchrun: `init_distributed` then makes a real
1-rank gloo group on a free local port. That keeps one code path for any world size (the model is always
`fully_shard`ed over a DeviceMesh, gradients are always DTensors, the collectives below always run), so what the
distributed tests check is what a single-process run executes. The collective helpers also accept being called
with no group at all (world size 1, identity) so that pure single-process tools and tests can use them.

Backends: gloo on the CPU; on CUDA a combined "cpu:gloo,cuda:nccl" group, so that CPU tensors (small bookkeeping
scalars, gradients under CPU offload) and CUDA tensors can both be reduced. The small reductions here always run on
CPU float64/int64 tensors, which keeps their results exact and independent of the device.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdptrain.config import validate_mesh_shape
from fsdptrain.distributed.placement import Bridge, Placement, set_bridge
from fsdptrain.distributed.torchrun import under_torchrun

DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
EP = "ep"
EP_REPLICA = "dp_shard_mod_ep"


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, node-local rank and the torch device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def attempt_store(store: torch.distributed.Store, group: str = "default_pg") -> torch.distributed.Store:
    """`store` under a key prefix of its own for this torchrun restart attempt (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's agent hosts one TCPStore for every restart of the worker group, and the ranks connect to it without a
    prefix; the process group's keys (each rank's gloo address) from a failed attempt are still there when the
    restarted ranks look them up, so a restarted rank would read a dead peer's address and fail or hang connecting
    to it. A prefix per attempt makes every attempt start from an empty namespace. The "default_pg" part is the
    prefix ``init_process_group`` itself would add; ``group`` names another group's namespace (the sides of a
    separate placement).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch.distributed.PrefixStore(f"fsdptrain/attempt_{attempt}/{group}", store)


def init_distributed(*, device_type: str, timeout_s: float = 600.0, generator_ranks: int = 0,
                     generator_timeout_s: float = 1800.0) -> DistInfo:
    """Create the default process group from torchrun's environment, or a 1-rank group when there is none.

    `device_type` is "cpu" (gloo) or "cuda" (nccl for CUDA tensors plus gloo for CPU tensors; the device is
    cuda:LOCAL_RANK). Idempotent: a second call returns the existing group's info.

    `generator_ranks` > 0 (``rollout.placement=separate``): the last ones of the launch are generator ranks; the
    default group spans this process's side only (the returned rank and world size are the side's) and the
    :class:`fsdptrain.distributed.placement.Bridge` between the sides is built (``placement.bridge()``).
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device_type='cuda' but no CUDA device is visible; use device_type='cpu'")
    if under_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        init_method = "env://"
    else:
        rank, world_size, local_rank = 0, 1, 0
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(torch.distributed.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        if generator_ranks:
            placement = Placement(trainers=world_size - generator_ranks, generators=generator_ranks,
                                  global_rank=rank)
            side = "generators" if placement.is_generator else "trainers"
            side_rank = placement.generator_index if placement.is_generator else rank
            side_size = generator_ranks if placement.is_generator else placement.trainers
            torch.distributed.init_process_group(backend=backend, store=attempt_store(store, side), rank=side_rank,
                                                 world_size=side_size, timeout=timeout)
            set_bridge(Bridge(attempt_store(store, "bridge"), placement, device=device,
                              timeout_s=generator_timeout_s))
        else:
            torch.distributed.init_process_group(backend=backend, store=attempt_store(store), rank=rank,
                                                 world_size=world_size, timeout=timeout)
    return DistInfo(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
                    local_rank=local_rank, device=device)


def destroy_distributed() -> None:
    """Destroy the default process group if there is one. Call it on the success path before `exit_process`."""
    set_bridge(None)
    _EXPERT_MESHES.clear()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> None:
    """Flush stdout and stderr and leave with `os._exit(code)`, keeping the real exit code.

    Processes that used gloo and fully_shard abort now and then in interpreter teardown, even after
    `destroy_process_group` ("terminate called without an active exception", exit -6; docs/architecture.md, the exit path); skipping
    the teardown is what makes the exit code trustworthy. Nothing after this call runs (no atexit handlers).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe must not change the exit code
            pass
    os._exit(code)


# ---------------------------------------------------------------------------------------------------------------
# Device mesh
# ---------------------------------------------------------------------------------------------------------------


def build_mesh(*, dp_replicate: int, dp_shard: int | None, device_type: str, cp: int = 1) -> DeviceMesh:
    """The FSDP DeviceMesh: 1-D ("dp_shard",) for FSDP when dp_replicate == 1, else 2-D ("dp_replicate",
    "dp_shard") for HSDP (parameters replicated across dim 0, sharded across dim 1).

    With context parallelism (`cp` > 1) the shard dimension spans dp_shard x cp ranks, as the anchors do: the
    parameters are sharded over the CP ranks too, not replicated on them. A CP group is cp consecutive ranks
    (`fsdptrain.distributed.context_parallel.build_context_group`). Requires the default process group
    (`init_distributed`).
    """
    dp_replicate, dp_shard = validate_mesh_shape(torch.distributed.get_world_size(), dp_replicate, dp_shard, cp)
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard * cp,), mesh_dim_names=(DP_SHARD,))
    return init_device_mesh(device_type, (dp_replicate, dp_shard * cp), mesh_dim_names=(DP_REPLICATE, DP_SHARD))


def build_expert_mesh(*, ep: int, device_type: str) -> DeviceMesh:
    """The experts' mesh of expert parallelism (``parallel.ep``, fsdptrain/distributed/expert_parallel.py): the
    data-parallel ranks split as ``(dp / ep, ep)``, dims ("dp_shard_mod_ep", "ep"). An EP group is ``ep`` consecutive
    ranks (rank ``r`` holds the experts of EP index ``r % ep``); the ranks of a "dp_shard_mod_ep" group hold the same
    experts and FSDP2 shards them over it. EP ranks are data-parallel ranks, as in torchtitan: it composes with plain
    FSDP (``dp_replicate=1``, ``cp=1``) only, refused otherwise in the config (fsdptrain/config/validate.py)."""
    size = torch.distributed.get_world_size()
    if ep < 1 or size % ep:
        raise ValueError(f"parallel.ep={ep} must divide the {size} data-parallel ranks")
    key = (device_type, size, ep)
    if key not in _EXPERT_MESHES:  # one per process: every model's experts on the same mesh object, as FSDP2 asks
        mesh = init_device_mesh(device_type, (size // ep, ep), mesh_dim_names=(EP_REPLICA, EP))
        # one flattened group over both dims, so a reduction over the whole mesh (a gradient norm, a full weight) is
        # one collective, not one per dim (DTensor finds it; torchtitan flattens its meshes the same way)
        mesh._flatten(f"{EP_REPLICA}_{EP}")
        _EXPERT_MESHES[key] = mesh
    return _EXPERT_MESHES[key]


_EXPERT_MESHES: dict[tuple[str, int, int], DeviceMesh] = {}


def dp_size(mesh: DeviceMesh) -> int:
    """Number of ranks FSDP2 averages gradients over: dp_replicate x dp_shard (x cp under context parallelism),
    which is why the loss carries this factor (docs/loss.md)."""
    return mesh.size()


# ---------------------------------------------------------------------------------------------------------------
# Small collectives (world-wide, on CPU tensors)
# ---------------------------------------------------------------------------------------------------------------

_REDUCE_OPS = {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN,
               "max": torch.distributed.ReduceOp.MAX}


def rank() -> int:
    """This process's global rank (0 with no process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 with no process group)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def all_reduce_f64(values: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce a flat float64 tensor over the whole world with op "sum", "min" or "max"; returns a new CPU
    tensor (the input is not modified). With no process group this is the identity (world size 1)."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    assert values.dtype == torch.float64 and values.dim() == 1, (values.dtype, values.shape)
    out = values.detach().to("cpu", copy=True)
    if world_size() > 1:
        torch.distributed.all_reduce(out, op=_REDUCE_OPS[op])
    return out


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """World-wide SUM of a flat float64 tensor (see `all_reduce_f64`)."""
    return all_reduce_f64(values, "sum")


def all_reduce_min(values: torch.Tensor) -> torch.Tensor:
    """World-wide element-wise MIN of a flat float64 tensor (see `all_reduce_f64`)."""
    return all_reduce_f64(values, "min")


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """World-wide element-wise MAX of a flat float64 tensor (see `all_reduce_f64`)."""
    return all_reduce_f64(values, "max")


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` with no process group."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def agree_max_int(value: int) -> int:
    """The largest `value` over all ranks (e.g. so every rank runs the same number of micro-batches)."""
    out = torch.tensor([int(value)], dtype=torch.int64)
    if world_size() > 1:
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return int(out.item())


def any_flag(flag: bool) -> bool:
    """World-wide logical or: True on every rank when `flag` is True on at least one (non-finite skip, SIGTERM)."""
    return agree_max_int(1 if flag else 0) == 1




def barrier() -> None:
    """Wait for every rank (no-op without a process group of more than one rank)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
