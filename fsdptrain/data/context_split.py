"""Context parallelism's split of one packed row across the ranks of a CP group (docs/packing.md, "Context
parallelism"). Pure torch: the collectives are fsdptrain/distributed/context_parallel.py's.

Legend: `_T` the whole row (T positions), `_L` this rank's positions of it (L = T / cp_size), in the order the rank
holds them.

The row is cut into 2 x cp_size equal chunks and rank r holds chunks r and 2 x cp_size - 1 - r (a head and a tail
chunk). Under causal attention a query at row position t attends up to t + 1 keys, so chunk c costs about c + 1/2
chunk-units of work; a head chunk and its mirrored tail chunk sum to the same 2 x cp_size units on every rank, which
a plain contiguous split (rank r: chunk r only) does not: its last rank would do 2 x cp_size - 1 times the first's.

Position ids and segments stay the row's: a rank's positions keep their position ids within their sequence (they do
not restart at a chunk), and its queries attend to the whole row's keys of their own segment only, up to their own
position. That is one `piece` per (chunk, segment) overlap: queries `[q_start, q_end)` of the rank's local layout
against the row's keys `[k_start, k_end)`, causal aligned bottom-right (the last query sees every key of the piece).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Local queries `[q_start, q_end)` attend to row keys `[k_start, k_end)`, causal aligned bottom-right."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_keys(self) -> int:
        return self.k_end - self.k_start


@dataclass(frozen=True)
class RowSplit:
    """Which positions of a row of `total_len` one rank of a CP group holds, and its attention pieces."""

    cp_size: int
    cp_rank: int
    total_len: int
    chunks: tuple[tuple[int, int], ...]  # row ranges [start, end) this rank holds, in its local order
    pieces: tuple[Piece, ...]  # in local query order, covering [0, L) exactly once

    @property
    def local_len(self) -> int:
        return sum(end - start for start, end in self.chunks)

    def local_index(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """long `[L]`: the row position of each local position."""
        return torch.cat([torch.arange(start, end, device=device) for start, end in self.chunks])

    def take(self, values_T: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's positions of a per-position tensor along `dim` (`[..., T, ...]` -> `[..., L, ...]`)."""
        return torch.cat([values_T.narrow(dim, start, end - start) for start, end in self.chunks], dim=dim)


def chunk_bounds(total_len: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The head and tail chunks `[start, end)` of rank `cp_rank`: chunks cp_rank and 2 x cp_size - 1 - cp_rank."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}) with cp_size >= 1, got cp_rank={cp_rank}")
    num_chunks = 2 * cp_size
    if total_len % num_chunks != 0:
        raise ValueError(f"a row of {total_len} positions cannot be split into {num_chunks} equal chunks for "
                         f"cp={cp_size}: pad it to a multiple of {num_chunks} (padded_length)")
    size = total_len // num_chunks
    head, tail = cp_rank, num_chunks - 1 - cp_rank
    return (head * size, (head + 1) * size), (tail * size, (tail + 1) * size)


def padded_length(num_tokens: int, cp_size: int) -> int:
    """The smallest row length >= `num_tokens` (and >= 1) that splits into 2 x cp_size equal chunks."""
    num_chunks = 2 * cp_size
    return max(-(-num_tokens // num_chunks), 1) * num_chunks


def split_row(segment_cu_seqlens: torch.Tensor, total_len: int, *, cp_size: int, cp_rank: int) -> RowSplit:
    """The split of a row whose attention segments are `segment_cu_seqlens` (int `[n + 1]` from 0 to `total_len`,
    the padding tail included: `PackedBatch.segment_cu_seqlens`) for rank `cp_rank` of `cp_size`."""
    bounds = [int(b) for b in segment_cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total_len:
        raise ValueError(f"segment boundaries must run from 0 to the row length {total_len}, got {bounds[0]} .. "
                         f"{bounds[-1]}; pass PackedBatch.segment_cu_seqlens()")
    chunks = chunk_bounds(total_len, cp_size, cp_rank)
    pieces, offset = [], 0
    for start, end in chunks:
        for seg_start, seg_end in zip(bounds[:-1], bounds[1:]):
            lo, hi = max(start, seg_start), min(end, seg_end)
            if lo < hi:
                pieces.append(Piece(offset + lo - start, offset + hi - start, seg_start, hi))
        offset += end - start
    return RowSplit(cp_size=cp_size, cp_rank=cp_rank, total_len=total_len, chunks=chunks, pieces=tuple(pieces))
