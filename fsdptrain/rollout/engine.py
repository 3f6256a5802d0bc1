"""The continuous rollout engine (docs/rollout.md): every request of this rank decoded in one loop, a row leaving
the batch at the step it ends, waiting rows entering as room frees, a row's cache kept for its next turn.

A :class:`Request` is one turn of one trajectory: the ids to prefill (the whole prompt on the first turn; only the
new tokens -- the last sampled token, the tool message and the template's separators -- on a later turn, onto the
:class:`KeptCache` the previous turn left), a token cap and a seed. :meth:`ContinuousEngine.run` decodes them all:

- **one decode loop**: each decode forward advances every live row by one token; a row that samples EOS or reaches
  its cap leaves at that step (its cache rows are dropped from the batch, or handed back as a :class:`KeptCache` when
  the request asks to ``keep`` it) and costs no further forward (``EngineStats.num_row_steps`` counts them);
- **admission bound**: waiting requests enter, in arrival order, while the live batch holds fewer than
  ``max_live_rows`` rows and fewer than ``max_live_tokens`` cache positions (rows x width of the padded batch); an
  empty batch always admits one request, so no request waits forever;
- **the cache** is one padded batch, left-aligned and compacted: when rows leave, the columns that every remaining row
  pads are cut, so its memory is live rows x the longest live row, never batch x (prompt + max_new_tokens);
- **shared prompts**: requests with no kept cache whose prompts repeat (a GRPO group) get their prompt's cache, all
  but the last token, from one forward per distinct prompt;
- **callbacks**: ``on_finish(finished)`` is called as each row leaves and may return the trajectory's next
  :class:`Request`, a ``concurrent.futures.Future`` of one (a tool running in a pool while the other rows decode;
  polled at every step) or None.

Sampling is row-seeded (:class:`fsdptrain.model.generate.RowSeededSampling`, the same Gumbel-max draw from the same
per-request ``torch.Generator``): a row's tokens depend on its prompt, its seed and the weights only, never on which
rows share its batch, how many, when it entered, or on which rank. ``seed`` None decodes greedily. The behaviour
log-prob of each sampled token is ``log_softmax(logits / temperature)`` of the generating forward at that token:
after temperature, before top-p (the distribution the training forward scores at ``rollout.temperature``).
"""

from __future__ import annotations

import concurrent.futures
import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Union

import torch


@dataclass
class KeptCache:
    """One row's keys and values, one ``(keys, values)`` pair of shape [heads, length, head_dim] per layer, for every
    token of its conversation but the last sampled one (which the next turn prefills)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]


@dataclass
class Request:
    """One turn of one trajectory; see the module docstring. ``key`` is the caller's, handed back in
    :class:`Finished`."""

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
    """What one :meth:`ContinuousEngine.run` cost: decode and prefill forwards, row-steps (one per live row per
    decode forward), the most rows live at once and the most cache positions (rows x padded width) held."""

    num_decode_forwards: int = 0
    num_prefill_forwards: int = 0
    num_row_steps: int = 0
    max_live_rows: int = 0
    max_cache_positions: int = 0


OnFinish = Callable[[Finished], Union[None, Request, "concurrent.futures.Future"]]


@dataclass
class _Row:
    request: Request
    generator: Optional[torch.Generator]
    length: int = 0  # real tokens in the cache
    last: int = 0  # the token the next decode forward feeds
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousEngine:
    """See the module docstring. ``model`` is a causal LM taking ``position_ids`` and a transformers cache."""

    def __init__(self, model, *, eos_id: int, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_live_rows: int = 64, max_live_tokens: int = 1 << 20):
        if max_live_rows < 1 or max_live_tokens < 1:
            raise ValueError(f"max_live_rows={max_live_rows}, max_live_tokens={max_live_tokens}: both must be >= 1")
        if not 0.0 < top_p <= 1.0 or temperature <= 0.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1] and temperature={temperature} > 0")
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.temperature, self.top_p = temperature, top_p
        self.max_live_rows, self.max_live_tokens = max_live_rows, max_live_tokens
        self.cache_name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.stats = EngineStats()
        self._rows: list[_Row] = []
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # live batch, each [rows, heads, width, dim]
        self._mask: Optional[torch.Tensor] = None  # [rows, width], left-aligned
        self._prefixes: dict[tuple[int, ...], KeptCache] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def run(self, requests: list[Request], on_finish: Optional[OnFinish] = None) -> list[Finished]:
        """Decode ``requests`` and every request ``on_finish`` adds; the finished ones in the order they left."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self._loop(deque(requests), on_finish or (lambda _: None))
        finally:
            self.model.train(was_training)
            self._rows, self._layers, self._mask, self._prefixes = [], [], None, {}

    def _loop(self, waiting: deque, on_finish: OnFinish) -> list[Finished]:
        done: list[Finished] = []
        pending: list[concurrent.futures.Future] = []

        def leave() -> None:
            for finished in self._leave():
                done.append(finished)
                follow = on_finish(finished)
                if isinstance(follow, concurrent.futures.Future):
                    pending.append(follow)
                elif follow is not None:
                    waiting.append(follow)

        while waiting or pending or self._rows:
            for future in [f for f in pending if f.done()]:
                pending.remove(future)
                if (request := future.result()) is not None:
                    waiting.append(request)
            if not waiting and not self._rows:
                concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                continue
            leave()  # rows that ended at the last decode forward free their room
            self._admit(waiting)
            leave()  # rows whose first token ended them
            if self._rows:
                self._decode()
        return done

    # admission -------------------------------------------------------------------------------------------------

    def _admit(self, waiting: deque) -> None:
        entering: list[Request] = []
        width = self._mask.shape[1] if self._mask is not None else 0
        while waiting and len(self._rows) + len(entering) < self.max_live_rows:
            request = waiting[0]
            need = (request.kept.length if request.kept else 0) + len(request.new_ids)
            rows = len(self._rows) + len(entering) + 1
            if (self._rows or entering) and rows * max(width, need) > self.max_live_tokens:
                break
            width = max(width, need)
            entering.append(waiting.popleft())
        if entering:
            self._prefill(self._with_shared_prefixes(entering, waiting))

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
                r = Request(r.key, r.new_ids[-1:], r.max_new_tokens, r.seed, self._prefixes[prefix], r.keep)
            out.append(r)
        self._prefixes = {p: c for p, c in self._prefixes.items() if p in later}
        return out

    def _forward_prefixes(self, prefixes: list[tuple[int, ...]]) -> list[KeptCache]:
        ids, mask = _left_pad([list(p) for p in prefixes], self.pad_id, self.device)
        layers, _ = self._forward(ids, mask, _positions(mask), cache_layers=None)
        self.stats.num_prefill_forwards += 1
        return [_row_cache(layers, mask, r) for r in range(len(prefixes))]

    def _prefill(self, entering: list[Request]) -> None:
        """One forward over the entering rows (each its kept cache, if any, then its new ids), their first token
        sampled, their cache left-aligned and joined to the live batch."""
        device = self.device
        kept_len = [r.kept.length if r.kept else 0 for r in entering]
        ids, new_mask = _left_pad([r.new_ids for r in entering], self.pad_id, device)
        cache_layers, cache_mask = None, torch.zeros(len(entering), 0, dtype=torch.long, device=device)
        if max(kept_len) > 0:
            cache_layers, cache_mask = _stack_kept([r.kept for r in entering], max(kept_len), self.model, device)
        mask = torch.cat([cache_mask, new_mask], dim=1)
        layers, logits = self._forward(ids, mask, _positions(mask)[:, cache_mask.shape[1]:], cache_layers)
        self.stats.num_prefill_forwards += 1
        rows = [_Row(r, _generator(r.seed, device), length=k + len(r.new_ids)) for r, k in zip(entering, kept_len)]
        layers, mask = _left_align(layers, mask)
        self._join(rows, layers, mask)
        self._sample(rows, logits)

    def _join(self, rows: list[_Row], layers, mask: torch.Tensor) -> None:
        if not self._rows:
            self._rows, self._layers, self._mask = rows, layers, mask
            return
        width = max(mask.shape[1], self._mask.shape[1])
        self._layers = [(torch.cat([_pad_left(k0, width, 2), _pad_left(k1, width, 2)]),
                         torch.cat([_pad_left(v0, width, 2), _pad_left(v1, width, 2)]))
                        for (k0, v0), (k1, v1) in zip(self._layers, layers)]
        self._mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(mask, width, 1)])
        self._rows = self._rows + rows

    # decoding --------------------------------------------------------------------------------------------------

    def _decode(self) -> None:
        """Every live row advances one token by one decode forward."""
        device = self.device
        ids = torch.tensor([[r.last] for r in self._rows], device=device)
        mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=self._mask.dtype, device=device)], 1)
        positions = torch.tensor([[r.length] for r in self._rows], device=device)
        self._layers, logits = self._forward(ids, mask, positions, self._layers)
        self._mask = mask
        self.stats.num_decode_forwards += 1
        self.stats.num_row_steps += len(self._rows)
        for r in self._rows:
            r.length += 1
        self._sample(self._rows, logits)

    def _leave(self) -> list[Finished]:
        gone = [i for i, r in enumerate(self._rows) if _ended(r, self.eos_id)]
        if not gone:
            return []
        out = [Finished(r.request.key, r.ids, r.logprobs, ended=bool(r.ids) and r.ids[-1] == self.eos_id,
                        kept=_row_cache(self._layers, self._mask, i) if r.request.keep else None)
               for i, r in ((i, self._rows[i]) for i in gone)]
        stay = [i for i in range(len(self._rows)) if i not in set(gone)]
        if not stay:
            self._rows, self._layers, self._mask = [], [], None
            return out
        index = torch.tensor(stay, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        cut = int((mask.cumsum(1) == 0).sum(1).min())  # columns every remaining row pads
        self._mask = mask[:, cut:]
        self._layers = [(k.index_select(0, index)[:, :, cut:], v.index_select(0, index)[:, :, cut:])
                        for k, v in self._layers]
        self._rows = [self._rows[i] for i in stay]
        return out

    def _forward(self, ids, mask, positions, cache_layers):
        from transformers import DynamicCache

        cache = DynamicCache()
        if cache_layers:  # the layers take the tensors as they are (a cache built from data would copy them)
            cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in cache_layers])
            for layer, (k, v) in zip(cache.layers, cache_layers):
                layer.keys, layer.values = k, v
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.cache_name: cache})
        cache = getattr(out, self.cache_name)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        rows, width = mask.shape
        self.stats.max_live_rows = max(self.stats.max_live_rows, rows)
        self.stats.max_cache_positions = max(self.stats.max_cache_positions, rows * width)
        return layers, out.logits[:, -1, :]

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_rows(logits, [r.generator for r in rows], temperature=self.temperature,
                                       top_p=self.top_p)
        for r, token, logprob in zip(rows, tokens, logprobs):
            r.ids.append(token)
            r.logprobs.append(logprob)
            r.last = token


def sample_rows(logits: torch.Tensor, generators: list[Optional[torch.Generator]], *, temperature: float,
                top_p: float) -> tuple[list[int], list[float]]:
    """Each row's next token and its behaviour log-prob (``log_softmax(logits / temperature)`` at the token).

    A row with a generator draws by :class:`fsdptrain.model.generate.RowSeededSampling`'s Gumbel-max (one float64
    uniform per vocabulary entry from its generator; with ``top_p`` < 1 the draw is over the nucleus, as
    transformers' ``TopPLogitsWarper`` cuts it); a row without one takes the argmax of its logits (greedy, its
    log-prob at temperature 1). The log-softmax and argmax run over the whole batch; only the uniforms are drawn row
    by row."""
    scores = logits.float()
    seeded = [g is not None for g in generators]
    logp = torch.log_softmax(scores / temperature, dim=-1) if any(seeded) else None
    greedy_logp = torch.log_softmax(scores, dim=-1) if not all(seeded) else None
    tokens = scores.argmax(-1)
    if any(seeded):
        rows = [r for r, s in enumerate(seeded) if s]
        drawn = logp[rows] if top_p >= 1.0 else torch.stack([_nucleus(logp[r], top_p) for r in rows])
        tiny = torch.finfo(torch.float64).tiny
        u = torch.stack([torch.rand(scores.shape[-1], generator=generators[r], device=scores.device,
                                    dtype=torch.float64) for r in rows]).clamp(tiny, 1.0 - 1e-16)
        tokens[rows] = (drawn + (-torch.log(-torch.log(u))).to(drawn.dtype)).argmax(-1)
    chosen = torch.stack([(logp if s else greedy_logp)[r] for r, s in enumerate(seeded)])
    values = chosen.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), values.tolist()


def _nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logp`` renormalised over the smallest set whose probability reaches ``top_p`` (-inf outside)."""
    sorted_logp, order = torch.sort(logp, descending=False)
    cut = sorted_logp.exp().cumsum(-1) <= 1 - top_p
    cut[-1] = False
    masked = logp.clone()
    masked[order[cut]] = float("-inf")
    return torch.log_softmax(masked, dim=-1)


def _ended(row: _Row, eos_id: int) -> bool:
    return bool(row.ids) and (row.ids[-1] == eos_id or len(row.ids) >= row.request.max_new_tokens)


def _generator(seed: Optional[int], device: torch.device) -> Optional[torch.Generator]:
    return None if seed is None else torch.Generator(device=device).manual_seed(int(seed))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s position ids: the count of real tokens before each position (pads get 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _stack_kept(kept: list[Optional[KeptCache]], width: int, model, device):
    """The kept caches as one left-padded batch (rows without one are all padding) and its mask."""
    template = next(k for k in kept if k is not None)
    layers = []
    for layer in range(len(template.layers)):
        pair = []
        for part in range(2):
            ref = template.layers[layer][part]
            empty = ref.new_zeros(ref.shape[0], 0, ref.shape[2])
            pair.append(torch.stack([_pad_left(k.layers[layer][part] if k else empty, width, 1) for k in kept]))
        layers.append(tuple(pair))
    mask = torch.tensor([[0] * (width - (k.length if k else 0)) + [1] * (k.length if k else 0) for k in kept],
                        device=device)
    return layers, mask


def _row_cache(layers, mask: torch.Tensor, row: int) -> KeptCache:
    keep = mask[row].bool()
    return KeptCache([(k[row][:, keep].clone(), v[row][:, keep].clone()) for k, v in layers])


def _left_align(layers, mask: torch.Tensor):
    """The batch with each row's real positions moved to its right end (no holes between a kept cache and the new
    ids), the columns every row pads cut."""
    lengths = mask.sum(1)
    width = int(lengths.max())
    columns = torch.arange(mask.shape[1], device=mask.device)
    if bool((mask.bool() == (columns >= mask.shape[1] - lengths[:, None])).all()):
        return [(k[:, :, -width:], v[:, :, -width:]) for k, v in layers], mask[:, -width:]
    rows = [_row_cache(layers, mask, r) for r in range(mask.shape[0])]
    aligned = []
    for layer in range(len(layers)):
        aligned.append(tuple(torch.stack([_pad_left(row.layers[layer][part], width, 1) for row in rows])
                             for part in range(2)))
    new_mask = torch.tensor([[0] * (width - int(n)) + [1] * int(n) for n in lengths], device=mask.device)
    return aligned, new_mask
