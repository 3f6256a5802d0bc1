"""The continuous engine's caches (fsdptrain/generation/continuous.py): the live batch's padded cache and the cache a
row keeps between turns.

- **the batch's cache** is one padded batch, right-aligned: every row ends at the last column, and its mask [rows,
  width] is 1 on each row's real columns (:func:`right_aligned_mask`). Per layer a keys and a values buffer [rows,
  heads, capacity, dim] whose capacity grows by whole blocks of ``CACHE_BLOCK`` columns (``BUCKETED_CACHE_BLOCK``
  where the decode step's shapes are bucketed). :class:`BufferLayer` is such a layer as transformers' cache sees it: a
  decode step writes its column in place, no per-step copy of the cache, where ``DynamicLayer`` copies the layer at
  every token; :class:`PackedLayer` is the same buffers in a fused decode-and-prefill forward, each packed token
  written to its own row and column;
- **a kept cache** (:class:`KeptCache`) is one row's keys and values, copied out of the batch when its turn ends
  (:func:`row_cache`) and held outside it while the trajectory waits (on a tool); it points at its group's shared
  prompt cache (``prefix``) rather than holding a copy. :func:`stack_kept` copies kept caches back into a batch, and
  :func:`right_align` moves each row's real positions to the right end after a prefill (no hole between a kept cache
  and the new ids);
- the batch's ids, mask and position ids are laid out as transformers' ``generate`` lays out a left-padded batch
  (:func:`left_pad_ids`, :func:`position_ids`).

Whatever rebuilds the buffers (:class:`BufferLayer` growing, :func:`right_align`, the engine's rows entering) replaces
them one tensor at a time, so a rebuild holds at most one layer's keys or values twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer

CACHE_BLOCK = 16
"""Cache columns allocated at a time on the CPU: a row's cache grows by one copy per block of tokens, and holds
less than a block of unused columns."""
BUCKETED_CACHE_BLOCK = 64
"""The same where the decode step's shapes are bucketed (CUDA): its cache width is a multiple of this."""


@dataclass
class KeptCache:
    """One row's keys and values, one ``(keys, values)`` pair of shape [heads, length, head_dim] per layer, for every
    token of its conversation but the last sampled one (which the next turn prefills). ``prefix``: the shared cache
    of its group's prompt, which comes before ``layers`` and is held once for all the group's rows."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    prefix: Optional["KeptCache"] = None

    @property
    def length(self) -> int:
        """The row's own positions (its shared prefix not counted)."""
        return self.layers[0][0].shape[1]

    @property
    def num_tokens(self) -> int:
        """Every position the cache covers, the shared prefix included: the next token's position id."""
        return self.length + (self.prefix.num_tokens if self.prefix is not None else 0)


class BufferLayer(DynamicLayer):
    """One layer of the engine's cache: keys and values in buffers [rows, heads, capacity, dim] used up to column
    ``length``. ``update`` writes the new states in place and returns views of the used columns (``expose``: of
    every column, the caller masking the unused ones, so the shapes stay those of the buffers); a full buffer grows to
    the next multiple of ``block`` columns (one copy per block of tokens, where DynamicLayer concatenates, a copy of
    the layer per token)."""

    def __init__(self, keys: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None, length: int = 0,
                 block: int = CACHE_BLOCK, expose: bool = False):
        super().__init__()
        self.buffers, self.length, self.block, self.expose = (keys, values), length, block, expose
        if keys is not None:
            self.device, self.is_initialized = keys.device, True
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized, self.length = key_states.device, True, 0
        self.buffers = (key_states[:, :, :0], value_states[:, :, :0])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.buffers[0].shape[2]:
            # one tensor at a time, this layer holding the only reference: the old buffer is freed before the next grows
            self.keys = self.values = None
            buffers = list(self.buffers)
            self.buffers = ()
            for part in range(2):
                buffers[part] = _grown(buffers[part], self.length, round_up(end, self.block))
            self.buffers = tuple(buffers)
        keys, values = self.buffers
        keys[:, :, self.length:end] = key_states
        values[:, :, self.length:end] = value_states
        self.length = end
        shown = keys.shape[2] if self.expose else end
        self.keys, self.values = keys[:, :, :shown], values[:, :, :shown]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.expose:
            return self.buffers[0].shape[2], 0
        return super().get_mask_sizes(query_length)


class PackedLayer(DynamicLayer):
    """One layer of a fused decode-and-prefill forward's cache (``ContinuousEngine._decode_entering``): the
    buffers [rows, heads, capacity, dim] and, per packed token, its row and column; ``update`` writes each token's
    keys and values there and returns the buffers' first ``end`` columns (the cache's ``buffers`` after it)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, end: int, rows: torch.Tensor,
                 columns: torch.Tensor):
        super().__init__()
        self.buffers, self.end, self.rows, self.columns = (keys, values), end, rows, columns
        self.device, self.is_initialized, self.length = keys.device, True, end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.buffers
        keys[self.rows, :, self.columns] = key_states[0].transpose(0, 1)  # [tokens, heads, dim]
        values[self.rows, :, self.columns] = value_states[0].transpose(0, 1)
        self.keys, self.values = keys[:, :, :self.end], values[:, :, :self.end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _grown(buffer: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    """``buffer``'s first ``used`` columns in a zeroed buffer of ``capacity`` columns."""
    grown = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
    grown[:, :, :used] = buffer[:, :, :used]
    return grown


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s position ids: the count of real tokens before each position (pads get 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def left_pad_ids(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], device=device)
    return ids, right_aligned_mask([len(r) for r in rows], width, device)


def right_aligned_mask(lengths: list[int], width: int, device) -> torch.Tensor:
    """[rows, width]: 1 on each row's last ``lengths[row]`` columns."""
    lengths_ = torch.tensor(lengths, device=device)
    return (torch.arange(width, device=device) >= width - lengths_[:, None]).long()


def pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def stack_kept(kept: list[Optional[KeptCache]], width: int, capacity: int, device):
    """The kept caches as one batch right-aligned to column ``width`` (rows without one are all padding), in
    buffers of ``capacity`` columns, and its mask [rows, width]."""
    template = next(k for k in kept if k is not None)
    rows_of: dict[int, list[int]] = {}  # a shared prompt's cache is one object: copied to all its rows at once
    for row, k in enumerate(kept):
        if k is not None:
            rows_of.setdefault(id(k), []).append(row)
    by_id = {id(k): k for k in kept if k is not None}
    layers = []
    for layer in range(len(template.layers)):
        pair = []
        for part in range(2):
            ref = template.layers[layer][part]
            buffer = ref.new_zeros(len(kept), ref.shape[0], capacity, ref.shape[2])
            for key, rows in rows_of.items():
                k = by_id[key]
                index = slice(rows[0], rows[-1] + 1) if _consecutive(rows) else rows
                buffer[index, :, width - k.length:width] = k.layers[layer][part]
            pair.append(buffer)
        layers.append(pair)
    return layers, right_aligned_mask([k.length if k else 0 for k in kept], width, device)


def _consecutive(rows: list[int]) -> bool:
    return rows[-1] - rows[0] == len(rows) - 1


def row_cache(layers, mask: torch.Tensor, row: int, prefix: Optional[KeptCache] = None) -> KeptCache:
    """A copy of ``row``'s real positions (the last ``mask[row].sum()`` columns of ``mask``'s width), after
    ``prefix``."""
    width, length = mask.shape[1], int(mask[row].sum())
    return KeptCache([tuple(t[row, :, width - length:width].clone(memory_format=torch.contiguous_format)
                            for t in pair) for pair in layers], prefix=prefix)


def right_align(layers: list[list[torch.Tensor]], mask: torch.Tensor, block: int) -> torch.Tensor:
    """Each row's real positions moved to the right end (no hole between a kept cache and the new ids), the columns
    every row pads cut; ``layers`` are replaced in place, one tensor at a time. The new mask."""
    lengths = mask.sum(1)
    width = int(lengths.max())
    columns = torch.arange(mask.shape[1], device=mask.device)
    if bool((mask.bool() == (columns >= mask.shape[1] - lengths[:, None])).all()):
        cut = mask.shape[1] - width
        for pair in layers:
            for part in range(2):
                pair[part] = pair[part][:, :, cut:]
        return mask[:, cut:]
    real = [mask[r].bool() for r in range(mask.shape[0])]
    for pair in layers:
        for part in range(2):
            old = pair[part][:, :, :mask.shape[1]]
            aligned = old.new_zeros(*old.shape[:2], round_up(width + 1, block), old.shape[3])
            for r, keep in enumerate(real):
                aligned[r, :, width - int(lengths[r]):width] = old[r][:, keep]
            pair[part] = aligned
    return right_aligned_mask(lengths.tolist(), width, mask.device)
