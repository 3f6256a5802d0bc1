"""The continuous rollout engine (docs/rollout.md): every request of this rank decoded in one loop, a row leaving
the batch at the step it ends, waiting rows entering as room frees, a row's cache kept for its next turn.

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
- **the cache** is one padded batch, right-aligned: per layer a keys and a values buffer [rows, heads, capacity, dim]
  whose capacity grows by whole blocks of ``CACHE_BLOCK`` columns (:class:`_BufferLayer`: a decode step writes its
  column in place, no per-step copy of the cache). When rows leave, a live row from above moves into each freed slot
  (one row copied per layer) and the buffers are narrowed to the live rows, the columns every remaining row pads cut
  (views: the memory goes at the next rebuild, at most a block of tokens later). Every rebuild (a buffer growing, rows
  entering, realigning) replaces the buffers one tensor at a time, so it holds at most one layer's keys or values
  twice. Its memory is live rows x (the longest live row's own tokens + less than a block) plus each live group's
  shared prompt once, never batch x (prompt + max_new_tokens). A request's kept cache is dropped as soon as it is
  copied into the batch;
- **a prefill inside the decode step**: rows that enter while others are live are prefilled in the live rows'
  decode forward (one packed sequence [1, tokens]: each live row's token, then each entering row's new ids;
  :meth:`ContinuousEngine._decode_entering`), on the CPU's exact shapes with the shared-prefix attention in use;
  otherwise they get a prefill forward of their own;
- **shapes**: exact on the CPU; on CUDA (``bucketed``) each decode forward runs at :func:`decode_shape`'s bucket of
  rows and cache columns, so that it can be captured or compiled once per bucket;
- **shared prompts**: requests with no kept cache whose prompts repeat (a GRPO group) get their prompt's cache, all
  but the last token, from one forward per distinct prompt. That cache is held once per group, not per row
  (:class:`_PrefixStack`): the batch's buffers hold each row's own tokens only, a kept cache points at its group's
  prefix, and the engine runs the model on its own attention function (``SHARED_PREFIX_ATTENTION``, registered
  with transformers' AttentionInterface; sdpa in any forward without prefixes) that takes one softmax over
  [prefix ; own keys] (:class:`_SharedPrefixes`). Models whose attention is not plain (sliding windows,
  soft-capping, sinks) or not dispatched through the interface keep a copy of the prefix in every row;
- **callbacks**: ``on_finish(finished)`` is called once per step with the rows that left at it and returns their
  follow-ups: requests, or ``concurrent.futures.Future`` objects each of a request, a list of them or None (tools
  running on a thread while the other rows decode; polled at every step).

Sampling is row-seeded (:class:`fsdptrain.generation.generate.RowSeededSampling`, the same Gumbel-max draw from the same
per-request ``torch.Generator``, whose uniforms :class:`RowNoise` draws several tokens at a time): a row's tokens
depend on its prompt, its seed and the weights only, never on which rows share its batch, how many, when it entered,
or on which rank. ``seed`` None decodes greedily. The behaviour log-prob of each sampled token is
``log_softmax(logits / temperature)`` of the generating forward at that token: after temperature, before top-p (the
distribution the training forward scores at ``rollout.temperature``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Optional, Union

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from fsdptrain.model.attention_switch import generation_attention

CACHE_BLOCK = 16
"""Cache columns allocated at a time on the CPU: a row's cache grows by one copy per block of tokens, and holds
less than a block of unused columns."""
BUCKETED_CACHE_BLOCK = 64
"""The same where the decode step's shapes are bucketed (CUDA): its cache width is a multiple of this."""
SHARED_PREFIX_MIN_TOKENS = 16
"""A group's prompt is held once only from this many cached tokens (a cache block) up: a shorter one is copied into
each of its rows, whose few columns cost less than the shared-prefix attention's fixed cost per forward (the default
tiny task's 3-token prefixes: 12.3 ms a 64-row rollout shared, 10.1 ms copied, one thread; docs/rollout.md)."""
PREFILL_CHUNK_VALUES = 1 << 16
"""A prefill onto shared prefixes copies each row's prefix keys and values for its attention, this many values
(rows x (prefix + own columns) x kv heads x head_dim) at a time, one layer at a time."""
NOISE_STEPS = 16
NOISE_ROW_VALUES = 1 << 14
"""A row's sampling noise is drawn up to ``NOISE_STEPS`` tokens at a time, at most ``NOISE_ROW_VALUES`` values (64
KiB of float32 a row: 16 tokens of a 1024-entry vocabulary; one token at a time from 16384 entries up)."""
SAMPLE_CHUNK_VALUES = 1 << 20
"""Uniforms drawn and used together, rows x vocabulary (8 MiB of float64): a 49152-entry vocabulary is sampled 21
rows at a time, not in one [rows, vocab] block; a small one all rows at once."""


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


@dataclass
class Request:
    """One turn of one trajectory; see the module docstring. ``key`` is the caller's, handed back in
    :class:`Finished`. The engine sets ``kept`` to None once that cache is copied into its batch (so the request does
    not keep it alive)."""

    key: Hashable
    new_ids: list[int]
    max_new_tokens: int
    seed: Optional[int] = None
    kept: Optional[KeptCache] = None
    keep: bool = False


@dataclass
class Finished:
    """A request's sampled ids (EOS included when it ended on one), their behaviour log-probs, whether it ended on
    EOS (not its cap), and (``keep``) the cache of its conversation but the last sampled token."""

    key: Hashable
    new_ids: list[int]
    logprobs: list[float]
    ended: bool
    kept: Optional[KeptCache] = None


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


OnFinish = Callable[[list[Finished]], Iterable[Union[Request, "concurrent.futures.Future"]]]


@dataclass
class _Row:
    request: Request
    noise: Optional["RowNoise"] = None  # the row's sampling noise (seeded rows), made at its first token
    length: int = 0  # real tokens in the cache, the shared prefix included
    prefix: Optional[KeptCache] = None  # the group's shared prompt cache, outside the batch's buffers
    last: int = 0  # the token the next decode forward feeds
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ended: bool = False  # it sampled EOS or reached its cap: it leaves at the next ``_leave``


class ContinuousEngine:
    """See the module docstring. ``model`` is a causal LM taking ``position_ids`` and a transformers cache.
    ``bucketed`` (default: on CUDA) runs each decode forward at :func:`decode_shape`'s bucketed shape.
    ``min_shared_prefix``: the shortest shared prompt cache (tokens) held once per group rather than copied per row."""

    def __init__(self, model, *, eos_id: int, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_live_rows: int = 64, max_live_tokens: int = 1 << 20, bucketed: Optional[bool] = None,
                 min_shared_prefix: int = SHARED_PREFIX_MIN_TOKENS, fuse_prefills: bool = True):
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
        self.share_prefixes = _can_share_prefixes(model)
        self.min_shared_prefix = min_shared_prefix
        self.fuse_prefills = fuse_prefills
        self._sharing = False  # this run holds long prompts once (``run``)
        self.stats = EngineStats()
        self._rows: list[_Row] = []
        self._num_ended = 0  # rows of the batch that ended since the last ``_leave``
        self._shared: Optional[tuple] = None  # ((stack, ids of the rows' prefixes), _SharedPrefixes, prefixes)
        self._layers: list[list[torch.Tensor]] = []  # live batch, [keys, values] each [rows, heads, capacity, dim]
        self._mask: Optional[torch.Tensor] = None  # [rows, width]: every row ends at the last column
        self._prefixes: dict[tuple[int, ...], KeptCache] = {}
        self._stack: Optional[_PrefixStack] = None  # the live rows' shared prefixes, one copy each

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def run(self, requests: list[Request], on_finish: Optional[OnFinish] = None) -> list[Finished]:
        """Decode ``requests`` and every request ``on_finish`` adds; the finished ones in the order they left."""
        was_training = self.model.training
        self.model.eval()
        attention = contextlib.nullcontext()
        # the shared-prefix attention only where a prompt is long enough to be held once: its dispatch costs every
        # forward (the follow-ups on_finish adds continue these requests' prompts)
        self._sharing = self.share_prefixes and any(
            r.kept is None and len(r.new_ids) - 1 >= self.min_shared_prefix for r in requests)
        if self._sharing:
            _register_shared_prefix_attention()
            attention = generation_attention(self.model, SHARED_PREFIX_ATTENTION)
        try:
            with attention:
                return self._loop(deque(requests), on_finish)
        finally:
            self.model.train(was_training)
            self._rows, self._layers, self._mask, self._prefixes, self._stack = [], [], None, {}, None
            self._num_ended, self._shared = 0, None

    def _loop(self, waiting: deque, on_finish: Optional[OnFinish]) -> list[Finished]:
        done: list[Finished] = []
        pending: list[concurrent.futures.Future] = []

        def leave() -> None:
            finished = self._leave()
            if not finished:
                return
            if on_finish is None:
                done.extend(finished)
                return
            # the kept caches go to on_finish only: `done` holding them would keep every turn's cache alive
            done.extend(Finished(f.key, f.new_ids, f.logprobs, f.ended) for f in finished)
            for follow in on_finish(finished):
                (pending if isinstance(follow, concurrent.futures.Future) else waiting).append(follow)

        while waiting or pending or self._rows:
            for future in [f for f in pending if f.done()]:
                pending.remove(future)
                result = future.result()
                waiting.extend(r for r in (result if isinstance(result, list) else [result]) if r is not None)
            if not waiting and not self._rows:
                concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
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
                r = Request(r.key, r.new_ids[-1:], r.max_new_tokens, r.seed, kept, r.keep)
            out.append(r)
        self._prefixes = {p: c for p, c in self._prefixes.items() if p in later}
        return out

    def _forward_prefixes(self, prefixes: list[tuple[int, ...]]) -> list[KeptCache]:
        ids, mask = _left_pad([list(p) for p in prefixes], self.pad_id, self.device)
        layers, _ = self._forward(ids, mask, _positions(mask), None, 0, prefixes=[None] * len(prefixes))
        self.stats.num_prefill_forwards += 1
        return [_row_cache(layers, mask, r) for r in range(len(prefixes))]

    def _prefill(self, entering: list[Request]) -> None:
        """One forward over the entering rows (each its kept cache, if any, then its new ids), their first token
        sampled, their cache right-aligned and joined to the live batch. The requests' kept caches are dropped once
        copied into the batch."""
        device = self.device
        kept_len = [r.kept.length if r.kept else 0 for r in entering]
        prefixes = [r.kept.prefix if r.kept else None for r in entering]
        prefix_len = [p.num_tokens if p is not None else 0 for p in prefixes]
        ids, new_mask = _left_pad([r.new_ids for r in entering], self.pad_id, device)
        width = max(kept_len)
        layers, cache_mask = None, torch.zeros(len(entering), 0, dtype=torch.long, device=device)
        if width > 0:
            capacity = _round_up(width + ids.shape[1], self.block)
            layers, cache_mask = _stack_kept([r.kept for r in entering], width, capacity, device)
        for r in entering:
            r.kept = None
        mask = torch.cat([cache_mask, new_mask], dim=1)
        positions = _positions(mask)[:, width:] + torch.tensor(prefix_len, device=device)[:, None]
        layers, logits = self._forward(ids, mask, positions, layers, width, prefixes=prefixes)
        self.stats.num_prefill_forwards += 1
        rows = [_Row(r, length=p + k + len(r.new_ids), prefix=prefix)
                for r, k, p, prefix in zip(entering, kept_len, prefix_len, prefixes)]
        mask = _right_align(layers, mask, self.block)
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
                                       _round_up(width + 1, self.block), ref.shape[3])
                joined[:num_live, :, width - live:width] = old[part][:num_live, :, :live]
                joined[num_live:num_live + len(rows), :, width - new:width] = entering[part][:len(rows), :, :new]
                old[part], entering[part] = joined, None  # both sources freed here, one tensor at a time
        self._mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(mask, width, 1)])
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
        same column; the forward writes each token's keys and values to its row and column (``_PackedLayer``); the
        attention (``_FusedAttention``) runs the live rows' queries as a decode step and the entering rows' as a
        prefill. Every row samples one token: the live rows their next, the entering rows their first."""
        device = self.device
        live, num_live = self._rows, len(self._rows)
        kept_len = [r.kept.length if r.kept else 0 for r in entering]
        prefixes = [r.kept.prefix if r.kept else None for r in entering]
        prefix_len = [p.num_tokens if p is not None else 0 for p in prefixes]
        new_len = [len(r.new_ids) for r in entering]
        width = self._mask.shape[1]
        end = max(width + 1, max(k + n for k, n in zip(kept_len, new_len)))  # every row's last column + 1
        capacity = _round_up(end + 1, self.block)
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
            torch.cat([_pad_left(self._mask, end - 1, 1), ones], 1),
            _right_aligned_mask([k + n for k, n in zip(kept_len, new_len)], end, device)])
        rows = [_Row(r, length=p + k + n, prefix=prefix)
                for r, k, n, p, prefix in zip(entering, kept_len, new_len, prefix_len, prefixes)]
        self._rows = live + rows
        ids = [r.last for r in live] + [i for r in entering for i in r.new_ids]
        positions = [r.length for r in live] + [p + k + j for p, k, n in zip(prefix_len, kept_len, new_len)
                                                for j in range(n)]
        row_of = list(range(num_live)) + [num_live + e for e, n in enumerate(new_len) for _ in range(n)]
        column_of = [end - 1] * num_live + [end - n + j for n in new_len for j in range(n)]
        last = list(range(num_live)) + list(itertools.accumulate(new_len, initial=num_live - 1))[1:]
        attention = _FusedAttention(self._shared_for([r.prefix for r in live]),
                                    _SharedPrefixes(self._stack, prefixes), self._mask, new_len)
        cache = Cache(layers=[_PackedLayer(k, v, end, torch.tensor(row_of, device=device),
                                           torch.tensor(column_of, device=device)) for k, v in self._layers])
        self._layers = []
        self._layers, logits = self._run_model(
            torch.tensor([ids], device=device), attention.mask_placeholder, torch.tensor([positions], device=device),
            cache, attention, self._mask.shape, logits_to_keep=torch.tensor(last, device=device))
        self.stats.num_decode_forwards += 1
        self.stats.num_prefills_in_decode += 1
        self.stats.num_row_steps += num_live
        for r in live:
            r.length += 1
        self._sample(self._rows, logits[0])

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

    def _leave(self) -> list[Finished]:
        """The rows that ended, out of the batch: each slot they free below the new row count takes a live row from
        above it (one row copied per layer, not the whole cache), the buffers are narrowed to the live rows and the
        columns every remaining row pads are cut (views: the memory is released at the next rebuild, at most
        a block of tokens later)."""
        if not self._num_ended:
            return []
        self._num_ended = 0
        gone = [i for i, r in enumerate(self._rows) if r.ended]
        out = [Finished(r.request.key, r.ids, r.logprobs, ended=bool(r.ids) and r.ids[-1] == self.eos_id,
                        kept=_row_cache(self._layers, self._mask, i, r.prefix) if r.request.keep else None)
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
            cache = Cache(layers=[_BufferLayer(k, v, length, self.block, expose) for k, v in layers])
            layers.clear()  # the cache's layers hold the only references, so a buffer that grows frees its old one
        else:
            cache = Cache(layer_class_to_replicate=lambda: _BufferLayer(block=self.block))
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

    def _shared_for(self, prefixes: list[Optional[KeptCache]]) -> "_SharedPrefixes":
        """The forward's rows (their ``prefixes``) in the prefix stack; the decode steps between two changes of the
        batch share one."""
        self._stack = self._stack_with(prefixes)
        key = (self._stack, [id(p) for p in prefixes])
        if self._shared is None or self._shared[0] != key:
            # the prefixes held with it, so that no id in its key is reused by another object while it is kept
            self._shared = (key, _SharedPrefixes(self._stack, prefixes), prefixes)
        shared = self._shared[1]
        shared.num_calls = 0
        return shared

    def _stack_with(self, prefixes: list[Optional[KeptCache]]) -> "_PrefixStack":
        """The prefix stack holding ``prefixes`` (and the live rows' own): the current one when it holds them and
        nothing else, else rebuilt (the old one freed first)."""
        wanted = {id(p): p for p in prefixes + [r.prefix for r in self._rows] if p is not None}
        if self._stack is not None and self._stack.ids == set(wanted):
            return self._stack
        self._stack = None
        return _PrefixStack(list(wanted.values()))

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        vocab = logits.shape[-1]
        for r in rows:
            if r.noise is None and r.request.seed is not None:  # a chunk: NOISE_STEPS tokens, NOISE_ROW_VALUES values
                steps = min(NOISE_STEPS, r.request.max_new_tokens, NOISE_ROW_VALUES // vocab)
                r.noise = RowNoise(r.request.seed, vocab, steps, logits.device, total=r.request.max_new_tokens)
        tokens, logprobs = sample_rows(logits, [r.noise for r in rows], temperature=self.temperature,
                                       top_p=self.top_p)
        for r, token, logprob in zip(rows, tokens, logprobs):
            r.ids.append(token)
            r.logprobs.append(logprob)
            r.last = token
            if token == self.eos_id or len(r.ids) >= r.request.max_new_tokens:
                r.ended = True
                self._num_ended += 1


class _PackedLayer(DynamicLayer):
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


class _BufferLayer(DynamicLayer):
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
                buffers[part] = _grown(buffers[part], self.length, _round_up(end, self.block))
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


def _can_share_prefixes(model) -> bool:
    """Whether a group's prompt cache can be held once (attention over [shared prefix ; own tokens]): the model's
    attention goes through transformers' AttentionInterface and is plain softmax attention over every earlier
    position (no sliding-window layer, no logit soft-capping, no attention sinks). Otherwise each row holds its own
    copy of its group's prompt cache, as before."""
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        return False
    config = model.config.get_text_config()
    plain = all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
    return (plain and getattr(config, "attn_logit_softcapping", None) is None
            and not any(hasattr(m, "sinks") for m in model.modules()))


SHARED_PREFIX_ATTENTION = "fsdptrain_shared_prefix"
"""The attention the engine runs the model on: sdpa, except in a forward given ``shared_prefixes``."""


def _register_shared_prefix_attention() -> None:
    if SHARED_PREFIX_ATTENTION not in AttentionInterface():
        AttentionInterface.register(SHARED_PREFIX_ATTENTION, shared_prefix_attention)
        AttentionMaskInterface.register(SHARED_PREFIX_ATTENTION, sdpa_mask)


def shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            shared_prefixes: Optional["_SharedPrefixes"] = None, **kwargs):
    """transformers' attention interface: sdpa over the cache's keys, or (``shared_prefixes`` given) one softmax
    over each row's shared prefix and its own keys."""
    if shared_prefixes is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return shared_prefixes.attend(module.layer_idx, query, key, value, attention_mask,
                                  query.shape[-1] ** -0.5 if scaling is None else scaling), None


class _PrefixStack:
    """Distinct shared prefixes, one copy each: per layer keys and values [kv heads, prefixes, width, dim] (the
    layout the decode step's matmul batches over), prefix g in columns [0, its length) (``valid``)."""

    def __init__(self, prefixes: list[KeptCache]):
        self.ids = {id(p) for p in prefixes}
        self.index = {id(p): g for g, p in enumerate(prefixes)}
        width = max(p.length for p in prefixes)
        ref = prefixes[0].layers[0][0]
        self.layers = []
        for layer in range(len(prefixes[0].layers)):
            pair = []
            for part in range(2):
                stacked = ref.new_zeros(ref.shape[0], len(prefixes), width, ref.shape[2])
                for g, p in enumerate(prefixes):
                    stacked[:, g, :p.length] = p.layers[layer][part]
                pair.append(stacked)
            self.layers.append(pair)
        lengths = torch.tensor([p.length for p in prefixes], device=ref.device)
        self.valid = torch.arange(width, device=ref.device) < lengths[:, None]
        self.num_positions = len(prefixes) * width


class _SharedPrefixes:
    """One forward's rows and their prefixes in the stack. Attention for a row (``attend``): one softmax over
    [its prefix's keys ; its own keys]. The prefix part is one matmul batched over (kv head, prefix), each prefix's
    rows gathered into its slots [kv heads, prefixes, slots x queries, dim]: the prefix is read once per forward and
    never copied per row. The own part is a batched matmul over the rows' own keys. A row without a prefix takes a
    slot of prefix 0 with every prefix column masked, so its prefix part is exactly zero."""

    def __init__(self, stack: _PrefixStack, prefixes: list[Optional[KeptCache]]):
        self.stack, self.num_calls = stack, 0
        groups = [stack.index[id(p)] if p is not None else -1 for p in prefixes]
        members: dict[int, int] = {}
        slot_of_row = []
        for g in groups:
            g = max(g, 0)
            slot_of_row.append((g, members.get(g, 0)))
            members[g] = members.get(g, 0) + 1
        self.num_groups, self.per_group = stack.valid.shape[0], max(members.values())
        slots = [g * self.per_group + j for g, j in slot_of_row]
        row_of_slot = [0] * (self.num_groups * self.per_group)  # an empty slot reads row 0: its result is never read
        for row, slot in enumerate(slots):
            row_of_slot[slot] = row
        device = stack.valid.device
        self.slot, self.row_of_slot = torch.tensor(slots, device=device), torch.tensor(row_of_slot, device=device)
        self.groups = torch.tensor(groups, device=device)
        self.visible = stack.valid[self.groups.clamp(min=0)] & (self.groups >= 0)[:, None]  # [rows, width]
        self._bias: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (own mask, its additive bias)

    def _bias_for(self, mask: torch.Tensor, dtype) -> torch.Tensor:
        """[rows, 1, 1, width + own]: 0 where a row sees the key, -inf elsewhere (the same for every layer)."""
        if self._bias is None or self._bias[0] is not mask:
            visible = torch.cat([self.visible[:, None, None, :], mask.expand(len(self.visible), 1, 1, -1)], dim=-1)
            bias = torch.zeros(visible.shape, dtype=dtype, device=mask.device).masked_fill_(~visible, float("-inf"))
            self._bias = (mask, bias)
        return self._bias[1]

    def attend(self, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        """``query`` [rows, heads, q, dim], the rows' own ``key``/``value`` [rows, kv heads, own, dim], ``mask``
        over the own keys (transformers' bool [rows, 1, q, own], or None: every key visible, causal when q == own).
        Returns [rows, q, heads, dim] as transformers' attention functions do."""
        self.num_calls += 1
        num_rows, heads, q_len, dim = query.shape
        kv_heads, own = key.shape[1], key.shape[2]
        if mask is None:  # transformers leaves it out when every key is visible (causal when q == own)
            mask = torch.ones(q_len, own, dtype=torch.bool, device=query.device).tril(own - q_len)[None, None]
        if q_len > 1:
            return self._attend_gathered(layer, query, key, value, mask.bool(), scaling)
        n = heads // kv_heads  # query head h reads kv head h // n
        keys, values = self.stack.layers[layer]
        width, grouped = keys.shape[2], (kv_heads, self.num_groups, self.per_group * n, dim)
        q = query.reshape(num_rows, kv_heads, n, dim) * scaling
        in_slots = q.transpose(0, 1).index_select(1, self.row_of_slot).view(grouped)
        scores_prefix = (in_slots @ keys.transpose(-1, -2)).view(kv_heads, -1, n, width).index_select(1, self.slot)
        scores = torch.cat([scores_prefix.transpose(0, 1), q @ key.transpose(-1, -2)], dim=-1)
        probs = torch.softmax(scores + self._bias_for(mask.bool(), scores.dtype), dim=-1)
        out = probs[..., width:] @ value
        probs_in_slots = probs[..., :width].transpose(0, 1).index_select(1, self.row_of_slot).view(
            kv_heads, self.num_groups, self.per_group * n, width)
        from_prefix = (probs_in_slots @ values).view(kv_heads, -1, n, dim).index_select(1, self.slot)
        out = out + from_prefix.transpose(0, 1)
        return out.view(num_rows, heads, 1, dim).transpose(1, 2).contiguous()

    def _attend_gathered(self, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        """A prefill (several queries a row, rare): sdpa over [prefix ; own keys] with each row's prefix copied
        to it, a chunk of rows at a time (``PREFILL_CHUNK_VALUES``), so the copies stay small and transient."""
        keys, values = self.stack.layers[layer]
        num_rows, kv_heads, own, dim = key.shape
        chunk = max(1, PREFILL_CHUNK_VALUES // ((keys.shape[2] + own) * kv_heads * dim))
        mask = mask.expand(num_rows, 1, *mask.shape[2:])
        out = []
        for start in range(0, num_rows, chunk):
            rows = slice(start, start + chunk)
            group = self.groups[rows].clamp(min=0)
            k = torch.cat([keys[:, group].transpose(0, 1), key[rows]], dim=2)
            v = torch.cat([values[:, group].transpose(0, 1), value[rows]], dim=2)
            m = torch.cat([self.visible[rows, None, None, :].expand(-1, 1, mask.shape[2], -1), mask[rows]], dim=-1)
            out.append(torch.nn.functional.scaled_dot_product_attention(
                query[rows], k, v, attn_mask=m, scale=scaling, enable_gqa=query.shape[1] != kv_heads))
        return torch.cat(out).transpose(1, 2).contiguous()


class _FusedAttention:
    """The attention of a fused decode-and-prefill forward: queries packed [1, heads, tokens, dim], each live row's
    one token first, then each entering row's new tokens. The live rows' queries attend as a decode step
    (``live``, :meth:`_SharedPrefixes.attend`), the entering rows' as a prefill (``entering``: left-padded to the
    longest, a pad query reading its row's first real token and that token's keys, its output dropped), over the
    batch's keys ``mask`` [rows, columns] shows (each entering row causally up to its own column). Returns [1,
    tokens, heads, dim]."""

    def __init__(self, live: "_SharedPrefixes", entering: "_SharedPrefixes", mask: torch.Tensor,
                 new_len: list[int]):
        self.live, self.entering, self.num_calls = live, entering, 0
        self.num_live, self.longest = mask.shape[0] - len(new_len), max(new_len)
        device, width, longest = mask.device, mask.shape[1], self.longest
        starts = itertools.accumulate(new_len, initial=self.num_live)
        self.query_index = torch.tensor([start + max(i - (longest - n), 0) for start, n in zip(starts, new_len)
                                         for i in range(longest)], device=device)
        self.out_index = torch.tensor([e * longest + longest - n + j for e, n in enumerate(new_len)
                                       for j in range(n)], device=device)
        visible = mask.bool()
        self.live_mask = visible[:self.num_live, None, None, :]
        last_column = torch.tensor([[width - longest + max(i, longest - n) for i in range(longest)]
                                    for n in new_len], device=device)  # [entering, longest]
        causal = torch.arange(width, device=device) <= last_column[:, :, None]
        self.entering_mask = visible[self.num_live:, None, None, :] & causal[:, None]  # [entering, 1, longest, width]
        self.mask_placeholder = visible[:1, None, None, :1]  # a 4D mask: transformers hands it on as it is

    def attend(self, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        self.num_calls += 1
        live, heads, dim = self.num_live, query.shape[1], query.shape[3]
        packed = query[0]  # [heads, tokens, dim]
        out_live = self.live.attend(layer, packed[:, :live].transpose(0, 1)[:, :, None], key[:live], value[:live],
                                    self.live_mask, scaling)  # [live, 1, heads, dim]
        entering = packed.index_select(1, self.query_index).view(heads, -1, self.longest, dim).transpose(0, 1)
        out_entering = self.entering.attend(layer, entering, key[live:], value[live:], self.entering_mask, scaling)
        out_entering = out_entering.reshape(-1, heads, dim).index_select(0, self.out_index)
        return torch.cat([out_live[:, 0], out_entering])[None]


def decode_shape(num_rows: int, width: int, *, bucketed: bool, block: int) -> tuple[int, int]:
    """The (rows, cache columns) a decode forward of ``num_rows`` live rows over ``width`` cache columns (the new
    token's included) runs at. On the CPU (not ``bucketed``) exactly those. Bucketed (CUDA), so that a captured CUDA
    graph or a compiled step meets few shapes: rows rounded up to a power of two up to 8 and to a multiple of 8
    beyond, columns to a multiple of ``block``."""
    if not bucketed:
        return num_rows, width
    rows = 1 << max(num_rows - 1, 0).bit_length() if num_rows <= 8 else _round_up(num_rows, 8)
    return rows, _round_up(width, block)


class RowNoise:
    """One row's Gumbel noise ``-log(-log(u))`` (float32, as the draw adds it) of its generator's float64
    uniforms, one vocabulary's worth per token, drawn ``steps`` tokens at a time: torch's CPU and CUDA generators give
    the same stream drawn in one piece or token by token (a unit test checks it), so a row's tokens are those of one
    draw per token, for one ``torch.rand`` call and two logarithms per chunk instead of per token.

    ``total``: the most tokens the row can draw (its cap). The first chunk is drawn at once, and the generator (2.5
    KiB of state on the CPU) is dropped as soon as the chunks drawn cover ``total``: a short row (the default task's
    6 tokens) holds only its noise, not a generator beside it."""

    def __init__(self, seed: int, vocab: int, steps: int, device: torch.device, total: Optional[int] = None):
        self.generator: Optional[torch.Generator] = torch.Generator(device=device).manual_seed(int(seed))
        self.vocab, self.steps, self.device = vocab, max(1, steps), device
        self.total, self.left = total, total  # tokens not yet drawn (None: no bound)
        self.chunk: list[torch.Tensor] = []  # the chunk's tokens, views made in one call (not one select a step)
        self.at = 0
        self._draw()

    def _draw(self) -> None:
        if self.generator is None:
            raise RuntimeError(f"RowNoise: a token drawn beyond its total of {self.total}")
        u = torch.rand(self.steps, self.vocab, generator=self.generator, device=self.device, dtype=torch.float64)
        u = u.clamp(torch.finfo(torch.float64).tiny, 1.0 - 1e-16)
        self.chunk, self.at = (-torch.log(-torch.log(u))).float().unbind(0), 0
        if self.left is not None:
            self.left -= self.steps
            if self.left <= 0:
                self.generator = None

    def next(self) -> torch.Tensor:
        if self.at == len(self.chunk):
            self._draw()
        self.at += 1
        return self.chunk[self.at - 1]


def sample_rows(logits: torch.Tensor, noises: list[Optional[RowNoise]], *, temperature: float,
                top_p: float) -> tuple[list[int], list[float]]:
    """Each row's next token and its behaviour log-prob (``log_softmax(logits / temperature)`` at the token).

    A row with noise draws by :class:`fsdptrain.generation.generate.RowSeededSampling`'s Gumbel-max (one float64
    uniform per vocabulary entry from its generator, :class:`RowNoise`; with ``top_p`` < 1 the draw is over the
    nucleus, as transformers' ``TopPLogitsWarper`` cuts it); a row without takes the argmax of its logits (greedy, its
    log-prob at temperature 1). Seeded rows are drawn in chunks of ``SAMPLE_CHUNK_VALUES`` values (each row's draw is
    its own, so the chunking changes no token); only the noise is gathered row by row."""
    scores = logits.float()
    if None not in noises and len(noises) * scores.shape[-1] <= SAMPLE_CHUNK_VALUES:  # the usual step: one chunk
        logp = torch.log_softmax(scores / temperature, dim=-1)
        drawn = logp if top_p >= 1.0 else torch.stack([_nucleus(row, top_p) for row in logp])
        chosen = (drawn + torch.stack([noise.next() for noise in noises])).argmax(-1)
        return chosen.tolist(), logp.gather(1, chosen[:, None])[:, 0].tolist()
    tokens = scores.argmax(-1)
    values = torch.empty(scores.shape[0], dtype=scores.dtype, device=scores.device)
    greedy = [r for r, g in enumerate(noises) if g is None]
    if greedy:
        index = torch.tensor(greedy, device=scores.device)
        picked = tokens.index_select(0, index)[:, None]
        values[index] = torch.log_softmax(scores.index_select(0, index), -1).gather(1, picked)[:, 0]
    seeded = [r for r, g in enumerate(noises) if g is not None]
    chunk = max(1, SAMPLE_CHUNK_VALUES // scores.shape[-1])
    for start in range(0, len(seeded), chunk):
        rows = seeded[start:start + chunk]
        index = torch.tensor(rows, device=scores.device)
        logp = torch.log_softmax(scores.index_select(0, index) / temperature, dim=-1)
        drawn = logp if top_p >= 1.0 else torch.stack([_nucleus(row, top_p) for row in logp])
        chosen = (drawn + torch.stack([noises[r].next() for r in rows])).argmax(-1)
        tokens[index] = chosen
        values[index] = logp.gather(1, chosen[:, None])[:, 0]
    return tokens.tolist(), values.tolist()


def _nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logp`` renormalised over the smallest set whose probability reaches ``top_p`` (-inf outside)."""
    sorted_logp, order = torch.sort(logp, descending=False)
    cut = sorted_logp.exp().cumsum(-1) <= 1 - top_p
    cut[-1] = False
    masked = logp.clone()
    masked[order[cut]] = float("-inf")
    return torch.log_softmax(masked, dim=-1)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _grown(buffer: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    """``buffer``'s first ``used`` columns in a zeroed buffer of ``capacity`` columns."""
    grown = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
    grown[:, :, :used] = buffer[:, :, :used]
    return grown


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s position ids: the count of real tokens before each position (pads get 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], device=device)
    return ids, _right_aligned_mask([len(r) for r in rows], width, device)


def _right_aligned_mask(lengths: list[int], width: int, device) -> torch.Tensor:
    """[rows, width]: 1 on each row's last ``lengths[row]`` columns."""
    lengths_ = torch.tensor(lengths, device=device)
    return (torch.arange(width, device=device) >= width - lengths_[:, None]).long()


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _stack_kept(kept: list[Optional[KeptCache]], width: int, capacity: int, device):
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
    return layers, _right_aligned_mask([k.length if k else 0 for k in kept], width, device)


def _consecutive(rows: list[int]) -> bool:
    return rows[-1] - rows[0] == len(rows) - 1


def _row_cache(layers, mask: torch.Tensor, row: int, prefix: Optional[KeptCache] = None) -> KeptCache:
    """A copy of ``row``'s real positions (the last ``mask[row].sum()`` columns of ``mask``'s width), after
    ``prefix``."""
    width, length = mask.shape[1], int(mask[row].sum())
    return KeptCache([tuple(t[row, :, width - length:width].clone(memory_format=torch.contiguous_format)
                            for t in pair) for pair in layers], prefix=prefix)


def _right_align(layers: list[list[torch.Tensor]], mask: torch.Tensor, block: int) -> torch.Tensor:
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
            aligned = old.new_zeros(*old.shape[:2], _round_up(width + 1, block), old.shape[3])
            for r, keep in enumerate(real):
                aligned[r, :, width - int(lengths[r]):width] = old[r][:, keep]
            pair[part] = aligned
    return _right_aligned_mask(lengths.tolist(), width, mask.device)
