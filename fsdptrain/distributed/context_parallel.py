"""Context parallelism (`parallel.cp`): one packed row's forward split across the ranks of a CP group
(docs/scaling.md, "Context parallelism").

The ranks of a CP group hold the same data-parallel batch. Each runs the model on its head and tail chunks of the
row (fsdptrain/data/context_split.py), with the row's position ids; in every attention layer the group all-gathers
the keys and values into the row's order (`ContextShard.gather`), so each query attends to its whole segment up to
itself (fsdptrain/model/attention_backends.py, `context_parallel_attention`). The per-token outputs the losses read
(log-probs, entropy, values) are then all-gathered into the whole row (`ContextShard.gather_tokens`): every rank of
the group computes the same loss over the same row, and the backward of that gather hands each rank the gradient of
its own positions only, so the group's gradients sum to the row's.

Why all-gathered keys and values rather than ring passes or Ulysses' all-to-all: packed rows hold many segments of
any length, and gloo (the CPU) has neither an overlapped ring nor a cheap all-to-all; one all-gather per layer is
exact for any segment layout and any number of heads (Ulysses needs the kv heads divisible by cp). Its volume per
layer and rank: forward, gathering K and V, receives 2 x (cp - 1)/cp x T x num_kv_heads x head_dim elements;
backward reduce-scatters their gradients (each rank's queries reach the whole row's keys), sending as many as the
forward received, and under activation checkpointing the recomputed forward gathers once more.

The gradient's factor: FSDP2 averages gradients over every rank of its mesh, dp x cp; the CP group's ranks' gradients
sum to its row's, so the loss carries dp x cp (`grad_average_size`), and the global normalisers count each token once
(docs/loss.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed

from fsdptrain.data.context_split import RowSplit, split_row
from fsdptrain.data.packing import PackedBatch


@dataclass(frozen=True)
class ContextGroup:
    """This rank's CP group: its process group (None for cp=1), its size and this rank's index in it."""

    group: Optional[torch.distributed.ProcessGroup]
    size: int
    rank: int

    @property
    def enabled(self) -> bool:
        return self.size > 1


NO_CONTEXT_PARALLEL = ContextGroup(group=None, size=1, rank=0)


def build_context_group(cp: int) -> ContextGroup:
    """The CP groups of the world: consecutive ranks ``[k cp, (k + 1) cp)``, one group per data-parallel rank k.
    Collective: every rank calls it with the same `cp` (``new_group`` is called for every group on every rank)."""
    if cp == 1:
        return NO_CONTEXT_PARALLEL
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if world_size % cp != 0:
        raise ValueError(f"parallel.cp={cp} does not divide the world size {world_size}")
    mine = None
    for start in range(0, world_size, cp):
        group = torch.distributed.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            mine = group
    return ContextGroup(group=mine, size=cp, rank=rank % cp)


def group_rollouts(rollouts: list, group: ContextGroup) -> list:
    """The CP group's rollouts, in rank order, on every rank of the group (collective within it): each rank generates
    its own rows as without CP, and the group trains the union, so its ranks agree on the rows of every pack."""
    if not group.enabled:
        return list(rollouts)
    parts = [None] * group.size
    torch.distributed.all_gather_object(parts, list(rollouts), group=group.group)
    return [rollout for part in parts for rollout in part]


class _GatherRow(torch.autograd.Function):
    """All-gather the local positions `[..., L, ...]` of every rank into the row `[..., T, ...]` (row order).

    Backward: with ``replicated_loss`` the loss downstream is the same on every rank of the group (each computed it
    over the whole gathered row), so each rank keeps its own positions' gradient; otherwise the downstream
    computation is this rank's own (its queries on the gathered keys), and each rank receives the group's sum of the
    gradients at its own positions (a reduce-scatter: each rank sends the others' positions only)."""

    @staticmethod
    def forward(ctx, local, shard: "ContextShard", dim: int, replicated_loss: bool):
        ctx.shard, ctx.dim, ctx.replicated_loss = shard, dim, replicated_loss
        parts = [torch.empty_like(local) for _ in range(shard.group.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=shard.group.group)
        return shard.assemble(parts, dim)

    @staticmethod
    def backward(ctx, grad_T):
        shard, dim = ctx.shard, ctx.dim
        if ctx.replicated_loss:
            return shard.split.take(grad_T, dim), None, None, None
        parts = [shard._split_of(rank).take(grad_T, dim).contiguous() for rank in range(shard.group.size)]
        grad_L = torch.empty_like(parts[shard.group.rank])
        torch.distributed.reduce_scatter(grad_L, parts, group=shard.group.group)
        return grad_L, None, None, None


@dataclass
class ContextShard:
    """One packed row as this rank of a CP group runs it: the split, the local model inputs, the collectives."""

    group: ContextGroup
    split: RowSplit
    device: torch.device
    _splits: dict = field(default_factory=dict)

    def assemble(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The row from every rank's local tensor (rank order): each rank's chunks placed at their row ranges."""
        pieces: dict[int, torch.Tensor] = {}
        for rank, local in enumerate(parts):
            chunks = self._split_of(rank).chunks
            offset = 0
            for start, end in chunks:
                pieces[start] = local.narrow(dim, offset, end - start)
                offset += end - start
        return torch.cat([pieces[start] for start in sorted(pieces)], dim=dim)

    def _split_of(self, rank: int) -> RowSplit:
        if rank == self.group.rank:
            return self.split
        if rank not in self._splits:  # only the chunk bounds are read: no segments needed
            cu = torch.tensor([0, self.split.total_len])
            self._splits[rank] = split_row(cu, self.split.total_len, cp_size=self.group.size, cp_rank=rank)
        return self._splits[rank]

    def gather(self, local: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Keys or values `[1, H, L, D]` -> `[1, H, T, D]` (differentiable: the group's gradients are summed)."""
        return _GatherRow.apply(local, self, dim, False)

    def gather_tokens(self, local_L: torch.Tensor) -> torch.Tensor:
        """Per-token outputs `[L]` -> `[T]` for a loss every rank of the group computes over the whole row."""
        return _GatherRow.apply(local_L, self, 0, True)

    def model_inputs(self, packed: PackedBatch) -> dict:
        """Keyword arguments of an HF causal LM's forward on this rank's positions of `packed` (the row's position
        ids, which do not restart at a chunk)."""
        return {
            "input_ids": self.split.take(packed.input_ids),
            "position_ids": self.split.take(packed.position_ids),
            "attention_mask": None,
            "use_cache": False,
            "context_shard": self,
        }


def shard_row(packed: PackedBatch, group: ContextGroup) -> ContextShard:
    """`packed` split for this rank of `group` (its length must split into 2 x cp equal chunks: pack with
    ``pad_to=padded_length(...)``)."""
    split = split_row(packed.segment_cu_seqlens(), packed.total_len, cp_size=group.size, cp_rank=group.rank)
    return ContextShard(group=group, split=split, device=packed.input_ids.device)
