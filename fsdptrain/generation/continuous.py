"""The continuous rollout engine (docs/rollout.md): every request of this rank decoded in one loop, a row leaving
the batch at the step it ends, waiting rows entering as room frees, a row's cache kept for its next turn. This module
is the scheduler; the caches it holds are fsdptrain/generation/kv_cache.py's, the attention that reads a group's
prompt once is fsdptrain/generation/shared_prefix.py's, and the draw of each token is
fsdptrain/generation/row_sampling.py's.

A :class:`Request` is one turn of one trajectory: the ids to prefill (the whole prompt on the first turn; only the
new tokens -- the last sampled token, the tool message and the template's separators -- on a later turn, onto the
:class:`KeptCache` the previous turn left), a token cap and a seed. :meth:`ContinuousEngine.run` decodes them all:

- **one decode loop**: each decode forward advances every live row by one token; a row that samples EOS or reaches
  its cap leaves at that step (its cache rows are dropped from the batch, or handed back as a :class:`KeptCache` when
  the request asks to ``keep`` it) and costs no further forward (``EngineStats.num_row_steps`` counts them);
- **admission bound**: waiting requests enter, continuing trajectories (with a kept cache) first and otherwise in
  arrival order, while the live batch holds fewer than
  ``max_live_rows`` rows and fewer than ``max_live_tokens`` cache positions (rows x width of the padded batch); an
  empty batch always admits one request, so no request waits forever;
- **the cache** is one padded batch, right-aligned, in buffers that grow by whole blocks of ``CACHE_BLOCK`` columns
  (:class:`BufferLayer`: a decode step writes its column in place, no per-step copy of the cache). When rows leave, a
  live row from above moves into each freed slot (one row copied per layer) and the buffers are narrowed to the live
  rows, the columns every remaining row pads cut (views: the memory goes at the next rebuild, at most a block of
  tokens later). Every rebuild (a buffer growing, rows entering, realigning) replaces the buffers one tensor at a
  time, so it holds at most one layer's keys or values twice. Its memory is live rows x (the longest live row's own
  tokens + less than a block) plus each live group's shared prompt once, never batch x (prompt + max_new_tokens). A
  request's kept cache is dropped as soon as it is copied into the batch;
- **a prefill inside the decode step**: rows that enter while others are live are prefilled in the live rows'
  decode forward (one packed sequence [1, tokens]: each live row's token, then each entering row's new ids;
  :meth:`ContinuousEngine._decode_entering`), on the CPU's exact shapes with the shared-prefix attention in use;
  otherwise they get a prefill forward of their own;
- **shapes**: exact on the CPU; on CUDA (``bucketed``) each decode forward runs at :func:`decode_shape`'s bucket of
  rows and cache columns, so that it can be captured or compiled once per bucket;
- **shared prompts**: requests with no kept cache whose prompts repeat (a GRPO group) get their prompt's cache, all
  but the last token, from one forward per distinct prompt. From ``SHARED_PREFIX_MIN_TOKENS`` cached tokens up, and
  where the model's attention allows it, that cache is held once per group, not per row: the batch's buffers hold
  each row's own tokens only, a kept cache points at its group's prefix, and the engine runs the model on the
  shared-prefix attention (``SHARED_PREFIX_ATTENTION``) for the duration of ``run``; otherwise each row holds a copy
  of its prefix;
- **callbacks**: ``on_finish(finished)`` is called once per step with the rows that left at it and returns their
  follow-ups: requests, or ``concurrent.futures.Future`` objects each of a request, a list of them or None (tools
  running on a thread while the other rows decode; polled at every step).

Sampling is row-seeded (:func:`sample_rows`, each seeded row's noise a :class:`RowNoise` made at its first token): a
row's tokens depend on its prompt, its seed and the weights only, never on which rows share its batch, how many, when
it entered, or on which rank. ``seed`` None decodes greedily. Each token's behaviour log-prob is the generating
forward's ``log_softmax(logits / temperature)`` at it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers.cache_utils import Cache

from fsdptrain.generation.arrivals import gather_arrivals, take_resolved
from fsdptrain.generation.block import generation
from fsdptrain.generation.decoder import Generated, OnFinish, Request, Sampling, active_recorder
from fsdptrain.generation.kv_cache import (
    BUCKETED_CACHE_BLOCK,
    CACHE_BLOCK,
    BufferLayer,
    KeptCache,
    PackedLayer,
    left_pad_ids,
    pad_left,
    position_ids,
    right_align,
    right_aligned_mask,
    round_up,
    row_cache,
    stack_kept,
)
from fsdptrain.generation.routes import RouteTape, joined, records_routes
from fsdptrain.generation.row_sampling import NOISE_ROW_VALUES, NOISE_STEPS, RowNoise, sample_rows
from fsdptrain.generation.shared_prefix import (
    SHARED_PREFIX_ATTENTION,
    SHARED_PREFIX_MIN_TOKENS,
    FusedAttention,
    PrefixStack,
    SharedPrefixes,
    can_share_prefixes,
    register_shared_prefix_attention,
)
from fsdptrain.model.attention_switch import generation_attention


@dataclass
class EngineStats:
    """What one :meth:`ContinuousEngine.run` cost: decode and prefill forwards (forwards of their own), the decode
    forwards that prefilled entering rows too, row-steps (one per live row per decode forward; the entering rows'
    first token not counted), the most rows live at once and the most cache positions (rows x padded width)
    held."""

    num_decode_forwards: int = 0
    num_prefill_forwards: int = 0
    num_prefills_in_decode: int = 0
    num_row_steps: int = 0
    max_live_rows: int = 0
    max_cache_positions: int = 0


def decode_shape(num_rows: int, width: int, *, bucketed: bool, block: int) -> tuple[int, int]:
    """The (rows, cache columns) a decode forward of ``num_rows`` live rows over ``width`` cache columns (the new
    token's included) runs at. On the CPU (not ``bucketed``) exactly those. Bucketed (CUDA), so that a captured CUDA
    graph or a compiled step meets few shapes: rows rounded up to a power of two up to 8 and to a multiple of 8
    beyond, columns to a multiple of ``block``."""
    if not bucketed:
        return num_rows, width
    rows = 1 << max(num_rows - 1, 0).bit_length() if num_rows <= 8 else round_up(num_rows, 8)
    return rows, round_up(width, block)


@dataclass
class _Row:
    request: Request
    noise: Optional["RowNoise"] = None  # the row's sampling noise (seeded rows), made at its first token
    length: int = 0  # real tokens in the cache, the shared prefix included
    prefix: Optional[KeptCache] = None  # the group's shared prompt cache, outside the batch's buffers
    last: int = 0  # the token the next decode forward feeds
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # [L, n, k] chunks of the tokens it fed (a MoE policy)
    ended: bool = False  # it sampled EOS or reached its cap: it leaves at the next ``_leave``


class ContinuousEngine:
    """See the module docstring. ``model`` is a causal LM taking ``position_ids`` and a transformers cache.
    ``bucketed`` (default: on CUDA) runs each decode forward at :func:`decode_shape`'s bucketed shape.
    ``min_shared_prefix``: the shortest shared prompt cache (tokens) held once per group rather than copied per row."""

    def __init__(self, model, *, eos_id: int, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_live_rows: int = 64, max_live_tokens: int = 1 << 20, bucketed: Optional[bool] = None,
                 min_shared_prefix: int = SHARED_PREFIX_MIN_TOKENS, fuse_prefills: bool = True,
                 record_routes: bool = False):
        if max_live_rows < 1 or max_live_tokens < 1:
            raise ValueError(f"max_live_rows={max_live_rows}, max_live_tokens={max_live_tokens}: both must be >= 1")
        if not 0.0 < top_p <= 1.0 or temperature <= 0.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1] and temperature={temperature} > 0")
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.temperature, self.top_p = temperature, top_p
        self.max_live_rows, self.max_live_tokens = max_live_rows, max_live_tokens
        self.bucketed = self.device.type == "cuda" if bucketed is None else bucketed
        self.block = BUCKETED_CACHE_BLOCK if self.bucketed else CACHE_BLOCK
        self.cache_name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.share_prefixes = can_share_prefixes(model)
        self.min_shared_prefix = min_shared_prefix
        self.fuse_prefills = fuse_prefills
        self._sharing = False  # this run holds long prompts once (``run``)
        self.stats = EngineStats()
        self._recorder = None  # the recorder of this run's `recording` block (fsdptrain/generation/decoder.py)
        self._rows: list[_Row] = []
        self._num_ended = 0  # rows of the batch that ended since the last ``_leave``
        self._shared: Optional[tuple] = None  # ((stack, ids of the rows' prefixes), SharedPrefixes, prefixes)
        self._layers: list[list[torch.Tensor]] = []  # live batch, [keys, values] each [rows, heads, capacity, dim]
        self._mask: Optional[torch.Tensor] = None  # [rows, width]: every row ends at the last column
        self._prefixes: dict[tuple[int, ...], KeptCache] = {}
        self._stack: Optional[PrefixStack] = None  # the live rows' shared prefixes, one copy each
        # routing replay (fsdptrain/generation/routes.py): each forward's routes, each shared prompt's, each
        # substituted request's (by key) until its row exists
        self._tape = RouteTape(model) if record_routes else None
        self._prefix_routes: dict[tuple[int, ...], torch.Tensor] = {}
        self._lead_routes: dict = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def run(self, requests: list, on_finish: Optional[OnFinish] = None) -> list[Generated]:
        """Decode ``requests`` and every request ``on_finish`` adds; the finished ones in the order they left. A
        request may be a future of one (a list of them, or None), decoded once it resolves, as a follow-up is."""
        was_training = self.model.training
        self.model.eval()
        self._recorder = active_recorder()
        # a caller whose first requests arrive later (the OpenAI endpoint, fsdptrain/rollout/endpoint.py) hands futures
        waiting = deque(r for r in requests if not isinstance(r, concurrent.futures.Future))
        later = [r for r in requests if isinstance(r, concurrent.futures.Future)]
        if later and not waiting:
            gather_arrivals(later, waiting)  # the first wave as one batch, its shared prompts seen together
        if self._recorder is not None:
            self._recorder.on_decode(list(waiting), follow_ups=on_finish is not None or bool(later))
        attention = contextlib.nullcontext()
        # the shared-prefix attention only where a prompt is long enough to be held once: its dispatch costs every
        # forward (the follow-ups on_finish adds continue these requests' prompts)
        self._sharing = self.share_prefixes and any(
            r.kept is None and len(r.new_ids) - 1 >= self.min_shared_prefix for r in waiting)
        if self._sharing:
            register_shared_prefix_attention()
            attention = generation_attention(self.model, SHARED_PREFIX_ATTENTION)
        recording = self._tape.recording() if self._tape is not None else contextlib.nullcontext()
        try:
            with attention, recording:
                return self._loop(waiting, on_finish, later)
        finally:
            self.model.train(was_training)
            self._rows, self._layers, self._mask, self._prefixes, self._stack = [], [], None, {}, None
            self._num_ended, self._shared, self._prefix_routes, self._lead_routes = 0, None, {}, {}

    def _loop(self, waiting: deque, on_finish: Optional[OnFinish],
              pending: list[concurrent.futures.Future]) -> list[Generated]:
        done: list[Generated] = []

        def leave() -> None:
            finished = self._leave()
            if not finished:
                return
            if on_finish is None:
                done.extend(finished)
                return
            # the kept caches go to on_finish only: `done` holding them would keep every turn's cache alive
            done.extend(dataclasses.replace(f, kept=None) for f in finished)
            for follow in on_finish(finished):
                (pending if isinstance(follow, concurrent.futures.Future) else waiting).append(follow)

        while waiting or pending or self._rows:
            take_resolved(pending, waiting)
            if not waiting and not self._rows:
                gather_arrivals(pending, waiting)
                continue
            leave()  # rows that ended at the last decode forward free their room
            entering = self._admit(waiting)
            if entering and self._fuses(entering):
                self._decode_entering(entering)
                continue
            if entering:
                self._prefill(entering)
                leave()  # rows whose first token ended them
            if self._rows:
                self._decode()
        return done

    # admission -------------------------------------------------------------------------------------------------

    def _admit(self, waiting: deque) -> list[Request]:
        """Continuing trajectories first (their kept caches are memory already held), then new requests in arrival
        order, within the bounds: taken out of ``waiting``, with their shared prompts' caches."""
        entering: list[Request] = []
        width = self._mask.shape[1] if self._mask is not None else 0
        for request in sorted(waiting, key=lambda r: r.kept is None):
            if len(self._rows) + len(entering) >= self.max_live_rows:
                break
            need = (request.kept.length if request.kept else 0) + len(request.new_ids)
            rows = len(self._rows) + len(entering) + 1
            if (self._rows or entering) and rows * max(width, need) > self.max_live_tokens:
                break
            width = max(width, need)
            entering.append(request)
        if entering:
            chosen = {id(r) for r in entering}
            remaining = [r for r in waiting if id(r) not in chosen]
            waiting.clear()
            waiting.extend(remaining)
            return self._with_shared_prefixes(entering, waiting)
        return []

    def _with_shared_prefixes(self, entering: list[Request], waiting: deque) -> list[Request]:
        """``entering`` with each repeated prompt's cache (all but its last token) computed once and given as the
        request's kept cache; the prefix is remembered while requests with it still wait."""
        later = {tuple(r.new_ids[:-1]) for r in waiting if r.kept is None}
        counts: dict[tuple[int, ...], int] = {}
        for r in entering:
            if r.kept is None and len(r.new_ids) > 1:
                counts[tuple(r.new_ids[:-1])] = counts.get(tuple(r.new_ids[:-1]), 0) + 1
        shared = [p for p, c in counts.items() if (c > 1 or p in later) and p not in self._prefixes]
        if shared:
            self._prefixes.update(zip(shared, self._forward_prefixes(shared)))
        out = []
        for r in entering:
            prefix = tuple(r.new_ids[:-1]) if r.kept is None else None
            if prefix in self._prefixes:
                kept = self._prefixes[prefix]
                if self._sharing and len(prefix) >= self.min_shared_prefix:  # the rows point at the one cache
                    kept = KeptCache([(k[:, :0], v[:, :0]) for k, v in kept.layers], prefix=kept)
                if self._tape is not None:  # the prompt's routes but its last token's, from the prefix's forward
                    self._lead_routes[r.key] = self._prefix_routes[prefix]
                r = Request(r.key, r.new_ids[-1:], r.max_new_tokens, r.seed, kept, r.keep)
            out.append(r)
        self._prefixes = {p: c for p, c in self._prefixes.items() if p in later}
        self._prefix_routes = {p: c for p, c in self._prefix_routes.items() if p in later}
        return out

    def _forward_prefixes(self, prefixes: list[tuple[int, ...]]) -> list[KeptCache]:
        ids, mask = left_pad_ids([list(p) for p in prefixes], self.pad_id, self.device)
        layers, _ = self._forward(ids, mask, position_ids(mask), None, 0, prefixes=[None] * len(prefixes))
        self.stats.num_prefill_forwards += 1
        if self._tape is not None:
            routes = self._tape.take(*ids.shape)
            width = ids.shape[1]
            self._prefix_routes.update((p, routes[:, r, width - len(p):]) for r, p in enumerate(prefixes))
        return [row_cache(layers, mask, r) for r in range(len(prefixes))]

    def _prefill(self, entering: list[Request]) -> None:
        """One forward over the entering rows (each its kept cache, if any, then its new ids), their first token
        sampled, their cache right-aligned and joined to the live batch. The requests' kept caches are dropped once
        copied into the batch."""
        device = self.device
        kept_len = [r.kept.length if r.kept else 0 for r in entering]
        prefixes = [r.kept.prefix if r.kept else None for r in entering]
        prefix_len = [p.num_tokens if p is not None else 0 for p in prefixes]
        ids, new_mask = left_pad_ids([r.new_ids for r in entering], self.pad_id, device)
        width = max(kept_len)
        layers, cache_mask = None, torch.zeros(len(entering), 0, dtype=torch.long, device=device)
        if width > 0:
            capacity = round_up(width + ids.shape[1], self.block)
            layers, cache_mask = stack_kept([r.kept for r in entering], width, capacity, device)
        for r in entering:
            r.kept = None
        mask = torch.cat([cache_mask, new_mask], dim=1)
        positions = position_ids(mask)[:, width:] + torch.tensor(prefix_len, device=device)[:, None]
        layers, logits = self._forward(ids, mask, positions, layers, width, prefixes=prefixes)
        self.stats.num_prefill_forwards += 1
        rows = [_Row(r, length=p + k + len(r.new_ids), prefix=prefix)
                for r, k, p, prefix in zip(entering, kept_len, prefix_len, prefixes)]
        if self._tape is not None:  # each row's new ids: the last columns of its left-padded row
            routes = self._tape.take(*ids.shape)
            for e, row in enumerate(rows):
                self._start_routes(row, routes[:, e, ids.shape[1] - len(row.request.new_ids):])
        mask = right_align(layers, mask, self.block)
        self._join(rows, layers, mask)
        self._sample(rows, logits)

    def _join(self, rows: list[_Row], layers: list[list[torch.Tensor]], mask: torch.Tensor) -> None:
        """The entering rows (``layers`` used up to ``mask``'s width) appended to the live batch, one tensor at a
        time."""
        if not self._rows:
            self._rows, self._layers, self._mask = rows, layers, mask
            return
        live, new = self._mask.shape[1], mask.shape[1]
        width = max(live, new)
        num_live = len(self._rows)
        for old, entering in zip(self._layers, layers):
            for part in range(2):
                ref = old[part]
                joined = ref.new_zeros(self._rows_at(num_live + len(rows)), ref.shape[1],
                                       round_up(width + 1, self.block), ref.shape[3])
                joined[:num_live, :, width - live:width] = old[part][:num_live, :, :live]
                joined[num_live:num_live + len(rows), :, width - new:width] = entering[part][:len(rows), :, :new]
                old[part], entering[part] = joined, None  # both sources freed here, one tensor at a time
        self._mask = torch.cat([pad_left(self._mask, width, 1), pad_left(mask, width, 1)])
        self._rows = self._rows + rows

    # decoding --------------------------------------------------------------------------------------------------

    def _rows_at(self, num_rows: int) -> int:
        return decode_shape(num_rows, 0, bucketed=self.bucketed, block=self.block)[0]

    def _decode(self) -> None:
        """Every live row advances one token by one decode forward; bucketed, at :func:`decode_shape`'s shape:
        padding rows (a pad id attending only to itself) and the cache's unused columns, masked."""
        device = self.device
        num_rows, width = len(self._rows), self._mask.shape[1]
        mask = torch.cat([self._mask, torch.ones(num_rows, 1, dtype=self._mask.dtype, device=device)], 1)
        rows, columns = decode_shape(num_rows, width + 1, bucketed=self.bucketed, block=self.block)
        padding = rows - num_rows
        ids = torch.tensor([r.last for r in self._rows] + [self.pad_id] * padding, device=device)[:, None]
        positions = torch.tensor([r.length for r in self._rows] + [0] * padding, device=device)[:, None]
        full_mask = mask
        if self.bucketed:
            self._fit(rows, columns)
            full_mask = mask.new_zeros(rows, columns)
            full_mask[:num_rows, :width + 1] = mask
            full_mask[num_rows:, width] = 1
        layers, self._layers = self._layers, []
        prefixes = [r.prefix for r in self._rows] + [None] * padding
        self._layers, logits = self._forward(ids, full_mask, positions, layers, width, expose=self.bucketed,
                                             prefixes=prefixes)
        logits = logits[:num_rows]
        if self._tape is not None:  # each live row fed its last sampled token
            routes = self._tape.take(rows, 1)
            for i, r in enumerate(self._rows):
                r.routes.append(routes[:, i])
        self._mask = mask
        self.stats.num_decode_forwards += 1
        self.stats.num_row_steps += len(self._rows)
        for r in self._rows:
            r.length += 1
        self._sample(self._rows, logits)

    def _fuses(self, entering: list[Request]) -> bool:
        """Whether the entering rows' prefill joins the live rows' decode step in one forward: on the CPU's exact
        shapes, with the engine's own attention in the model (``_sharing``) and a shared prompt among the rows."""
        if not self.fuse_prefills or not self._rows or not self._sharing or self.bucketed:
            return False
        return (any(r.prefix is not None for r in self._rows)
                or any(r.kept is not None and r.kept.prefix is not None for r in entering))

    def _decode_entering(self, entering: list[Request]) -> None:
        """One forward for a decode step and a prefill: every live row's next token and each entering row's new ids
        (onto its kept cache) packed into one sequence [1, tokens], no padding. The entering rows' kept caches join
        the batch first (one rebuild, as ``_join``), right-aligned so that after the forward every row ends at the
        same column; the forward writes each token's keys and values to its row and column (``PackedLayer``); the
        attention (``FusedAttention``) runs the live rows' queries as a decode step and the entering rows' as a
        prefill. Every row samples one token: the live rows their next, the entering rows their first."""
        device = self.device
        live, num_live = self._rows, len(self._rows)
        kept_len = [r.kept.length if r.kept else 0 for r in entering]
        prefixes = [r.kept.prefix if r.kept else None for r in entering]
        prefix_len = [p.num_tokens if p is not None else 0 for p in prefixes]
        new_len = [len(r.new_ids) for r in entering]
        width = self._mask.shape[1]
        end = max(width + 1, max(k + n for k, n in zip(kept_len, new_len)))  # every row's last column + 1
        capacity = round_up(end + 1, self.block)
        for layer, pair in enumerate(self._layers):
            for part in range(2):
                ref = pair[part]
                joined = ref.new_zeros(num_live + len(entering), ref.shape[1], capacity, ref.shape[3])
                joined[:num_live, :, end - 1 - width:end - 1] = ref[:num_live, :, :width]
                for e, (r, k, n) in enumerate(zip(entering, kept_len, new_len)):
                    if k:
                        joined[num_live + e, :, end - n - k:end - n] = r.kept.layers[layer][part]
                pair[part] = joined  # the old buffer freed here, one tensor at a time
        for r in entering:
            r.kept = None
        ones = torch.ones(num_live, 1, dtype=self._mask.dtype, device=device)
        self._mask = torch.cat([
            torch.cat([pad_left(self._mask, end - 1, 1), ones], 1),
            right_aligned_mask([k + n for k, n in zip(kept_len, new_len)], end, device)])
        rows = [_Row(r, length=p + k + n, prefix=prefix)
                for r, k, n, p, prefix in zip(entering, kept_len, new_len, prefix_len, prefixes)]
        self._rows = live + rows
        ids = [r.last for r in live] + [i for r in entering for i in r.new_ids]
        positions = [r.length for r in live] + [p + k + j for p, k, n in zip(prefix_len, kept_len, new_len)
                                                for j in range(n)]
        row_of = list(range(num_live)) + [num_live + e for e, n in enumerate(new_len) for _ in range(n)]
        column_of = [end - 1] * num_live + [end - n + j for n in new_len for j in range(n)]
        last = list(range(num_live)) + list(itertools.accumulate(new_len, initial=num_live - 1))[1:]
        attention = FusedAttention(self._shared_for([r.prefix for r in live]),
                                    SharedPrefixes(self._stack, prefixes), self._mask, new_len)
        cache = Cache(layers=[PackedLayer(k, v, end, torch.tensor(row_of, device=device),
                                           torch.tensor(column_of, device=device)) for k, v in self._layers])
        self._layers = []
        self._layers, logits = self._run_model(
            torch.tensor([ids], device=device), attention.mask_placeholder, torch.tensor([positions], device=device),
            cache, attention, self._mask.shape, logits_to_keep=torch.tensor(last, device=device))
        self.stats.num_decode_forwards += 1
        self.stats.num_prefills_in_decode += 1
        self.stats.num_row_steps += num_live
        if self._tape is not None:  # the packed row: each live row's token, then each entering row's new ids
            routes = self._tape.take(1, len(ids))[:, 0]
            for i, r in enumerate(live):
                r.routes.append(routes[:, i:i + 1])
            starts = itertools.accumulate(new_len, initial=num_live)
            for r, start, n in zip(rows, starts, new_len):
                self._start_routes(r, routes[:, start:start + n])
        for r in live:
            r.length += 1
        self._sample(self._rows, logits[0])

    def _start_routes(self, row: _Row, routes: torch.Tensor) -> None:
        """An entering row's first routes: its shared prompt's (when its request was given the prompt's cache), then
        those of the new ids it fed."""
        lead = self._lead_routes.pop(row.request.key, None)
        row.routes = ([lead] if lead is not None else []) + [routes]

    def _fit(self, rows: int, columns: int) -> None:
        """Bucketed: the buffers at exactly ``rows`` rows and at least ``columns`` columns (a copy only when
        short)."""
        for pair in self._layers:
            for part in range(2):
                t = pair[part]
                if t.shape[0] < rows or t.shape[2] < columns:
                    grown = t.new_zeros(rows, t.shape[1], max(columns, t.shape[2]), t.shape[3])
                    grown[:min(rows, t.shape[0]), :, :t.shape[2]] = t[:rows]
                    t = grown
                pair[part] = t[:rows]

    def _leave(self) -> list[Generated]:
        """The rows that ended, out of the batch: each slot they free below the new row count takes a live row from
        above it (one row copied per layer, not the whole cache), the buffers are narrowed to the live rows and the
        columns every remaining row pads are cut (views: the memory is released at the next rebuild, at most
        a block of tokens later)."""
        if not self._num_ended:
            return []
        self._num_ended = 0
        gone = [i for i, r in enumerate(self._rows) if r.ended]
        out = [Generated(r.request.key, r.ids, r.logprobs, ended=bool(r.ids) and r.ids[-1] == self.eos_id,
                        kept=row_cache(self._layers, self._mask, i, r.prefix) if r.request.keep else None,
                        routes=joined(r.routes) if self._tape is not None else None)
               for i, r in ((i, self._rows[i]) for i in gone)]
        num_rows = len(self._rows) - len(gone)
        if num_rows == 0:
            self._rows, self._layers, self._mask, self._stack = [], [], None, None
            return out
        holes = [i for i in gone if i < num_rows]
        leaving = set(gone)
        movers = [i for i in range(num_rows, len(self._rows)) if i not in leaving]
        rows, mask = list(self._rows), self._mask.clone()
        for hole, mover in zip(holes, movers, strict=True):
            rows[hole] = rows[mover]
            mask[hole] = mask[mover]
            for pair in self._layers:
                for part in range(2):
                    pair[part][hole] = pair[part][mover]
        mask = mask[:num_rows]
        cut = int((mask.cumsum(1) == 0).sum(1).min())  # columns every remaining row pads
        keep = self._rows_at(num_rows)  # bucketed: the rows above the live ones stay as padding rows
        for pair in self._layers:
            for part in range(2):
                pair[part] = pair[part][:keep, :, cut:]
        self._rows, self._mask = rows[:num_rows], mask[:, cut:]
        return out

    def _forward(self, ids, mask, positions, layers, length: int, *, prefixes: list[Optional[KeptCache]],
                 expose: bool = False):
        """One forward of ``ids`` onto the cache ``layers`` (used up to column ``length``; None: an empty cache;
        ``expose``: attention over every column of the buffers, ``mask`` as wide), each row also attending to its
        shared prefix (``prefixes``, one per row, None: none); the updated buffers (per layer a [keys, values] list)
        and the last position's logits."""
        shared = self._shared_for(prefixes) if any(p is not None for p in prefixes) else None
        if layers:
            cache = Cache(layers=[BufferLayer(k, v, length, self.block, expose) for k, v in layers])
            layers.clear()  # the cache's layers hold the only references, so a buffer that grows frees its old one
        else:
            cache = Cache(layer_class_to_replicate=lambda: BufferLayer(block=self.block))
        model_mask = mask
        if ids.shape[1] == 1 and not expose:  # a decode step's mask is the padding mask: built here, not per forward
            model_mask = mask.bool()[:, None, None, :]  # by transformers' mask functions (a quarter of a tiny step)
        layers, logits = self._run_model(ids, model_mask, positions, cache, shared, mask.shape, logits_to_keep=1)
        return layers, logits[:, -1, :]

    def _run_model(self, ids, mask, positions, cache, shared, cache_shape: tuple[int, int], *, logits_to_keep):
        """The model's forward (``shared``: the attention's ``shared_prefixes`` argument, checked to have reached
        every layer); the updated buffers and the kept logits. ``cache_shape``: the batch's (rows, columns)."""
        extra = {"shared_prefixes": shared} if shared is not None else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=logits_to_keep, **{self.cache_name: cache}, **extra)
        layers = [list(layer.buffers) for layer in getattr(out, self.cache_name).layers]
        if shared is not None and shared.num_calls != len(layers):
            raise RuntimeError(f"{type(self.model).__name__}'s attention saw the shared prefixes in {shared.num_calls} "
                               f"of {len(layers)} layers: it does not pass the forward's keyword arguments on")
        rows, width = cache_shape
        self.stats.max_live_rows = max(self.stats.max_live_rows, rows)
        held = self._stack.num_positions if self._stack is not None else 0
        self.stats.max_cache_positions = max(self.stats.max_cache_positions, rows * width + held)
        return layers, out.logits

    def _shared_for(self, prefixes: list[Optional[KeptCache]]) -> "SharedPrefixes":
        """The forward's rows (their ``prefixes``) in the prefix stack; the decode steps between two changes of the
        batch share one."""
        self._stack = self._stack_with(prefixes)
        key = (self._stack, [id(p) for p in prefixes])
        if self._shared is None or self._shared[0] != key:
            # the prefixes held with it, so that no id in its key is reused by another object while it is kept
            self._shared = (key, SharedPrefixes(self._stack, prefixes), prefixes)
        shared = self._shared[1]
        shared.num_calls = 0
        return shared

    def _stack_with(self, prefixes: list[Optional[KeptCache]]) -> "PrefixStack":
        """The prefix stack holding ``prefixes`` (and the live rows' own): the current one when it holds them and
        nothing else, else rebuilt (the old one freed first)."""
        wanted = {id(p): p for p in prefixes + [r.prefix for r in self._rows] if p is not None}
        if self._stack is not None and self._stack.ids == set(wanted):
            return self._stack
        self._stack = None
        return PrefixStack(list(wanted.values()))

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        vocab = logits.shape[-1]
        for r in rows:
            if r.noise is None and r.request.seed is not None:  # a chunk: NOISE_STEPS tokens, NOISE_ROW_VALUES values
                steps = min(NOISE_STEPS, r.request.max_new_tokens, NOISE_ROW_VALUES // vocab)
                r.noise = RowNoise(r.request.seed, vocab, steps, logits.device, total=r.request.max_new_tokens)
        tokens, logprobs = sample_rows(logits, [r.noise for r in rows], temperature=self.temperature,
                                       top_p=self.top_p)
        for r, token, logprob in zip(rows, tokens, logprobs):
            if self._recorder is not None:
                self._recorder.on_tokens(r.request.key, [token], [logprob])
            r.ids.append(token)
            r.logprobs.append(logprob)
            r.last = token
            if token == self.eos_id or len(r.ids) >= r.request.max_new_tokens:
                r.ended = True
                self._num_ended += 1


class ContinuousDecoder:
    """The :class:`~fsdptrain.generation.decoder.Decoder` of ``rollout.engine=continuous``: each ``decode`` one
    :meth:`ContinuousEngine.run` at the call's temperature and top-p, bounded by ``rollout.max_live_rows`` and
    ``rollout.max_live_tokens``. Ranks run their own numbers of forwards, so its block always gathers the policy's
    weights on several ranks."""

    def __init__(self, cfg, model, tokenizer, device):
        self.cfg, self.model, self.tokenizer, self.device = cfg, model, tokenizer, device

    def generating(self, *, uneven: bool = False):
        return generation(self.model, self.cfg, self.device, always_gather=True)

    def decode(self, requests, sampling: Sampling, *, on_finish: Optional[OnFinish] = None) -> list[Generated]:
        rollout = self.cfg.rollout
        engine = ContinuousEngine(self.model, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
                                  temperature=sampling.temperature, top_p=sampling.top_p,
                                  max_live_rows=rollout.max_live_rows, max_live_tokens=rollout.max_live_tokens,
                                  record_routes=records_routes(self.model, sampling.mode))
        return engine.run(list(requests), on_finish)
