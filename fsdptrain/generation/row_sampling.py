"""Row-seeded sampling (docs/rollout.md, "Seeds and what stays exact"): each row draws its tokens from its own
``torch.Generator``, seeded per request, by the Gumbel-max trick (:class:`RowSeededSampling`), so a row's tokens
depend on its prompt, its seed and the weights only, never on which rows share its batch, how many, when it entered,
or on which rank. A row without a seed decodes greedily.

- :class:`RowSeededSampling`: the draw as a transformers logits processor, for ``generate``
  (fsdptrain/generation/generate.py, ``row_seeds``): one uniform per vocabulary entry from every row's generator at
  every step;
- :class:`RowNoise` and :func:`sample_rows`: the continuous engine's (fsdptrain/generation/continuous.py) same draw
  from the same per-request generator, whose uniforms :class:`RowNoise` draws several tokens at a time.

The behaviour log-prob of each sampled token is ``log_softmax(logits / temperature)`` of the generating forward at
that token: after temperature, before top-p (the distribution the training forward scores at
``rollout.temperature``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import LogitsProcessor

NOISE_STEPS = 16
NOISE_ROW_VALUES = 1 << 14
"""A row's sampling noise is drawn up to ``NOISE_STEPS`` tokens at a time, at most ``NOISE_ROW_VALUES`` values (64
KiB of float32 a row: 16 tokens of a 1024-entry vocabulary; one token at a time from 16384 entries up)."""
SAMPLE_CHUNK_VALUES = 1 << 20
"""Uniforms drawn and used together, rows x vocabulary (8 MiB of float64): a 49152-entry vocabulary is sampled 21
rows at a time, not in one [rows, vocab] block; a small one all rows at once."""


class RowSeededSampling(LogitsProcessor):
    """Sampling at ``temperature`` where row r draws from its own generator seeded with ``seeds[r]``, by the
    Gumbel-max trick: with G_v = -log(-log U_v), U_v ~ U(0, 1) i.i.d., argmax_v (log_softmax(z / T)_v + G_v) is an
    exact draw from softmax(z / T). Under greedy decoding this processor turns the argmax into that draw. A row's
    tokens depend on its prompt, its seed and the model only, never on the other rows of the batch (how many, in
    what order, on which rank), and torch's global RNG is never touched. Each decoding step draws one uniform per
    vocabulary entry from every row's generator (float64, kept inside (0, 1))."""

    def __init__(self, seeds: Sequence[int], *, temperature: float, device: torch.device):
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        assert scores.shape[0] == len(self.generators), "one seed per row of the batch"
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        tiny = torch.finfo(torch.float64).tiny
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device, dtype=torch.float64)
                         for g in self.generators]).clamp(tiny, 1.0 - 1e-16)
        return logp + (-torch.log(-torch.log(u))).to(logp.dtype)


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

    A row with noise draws by :class:`RowSeededSampling`'s Gumbel-max (one float64 uniform per vocabulary entry from
    its generator, :class:`RowNoise`; with ``top_p`` < 1 the draw is over the nucleus, as transformers'
    ``TopPLogitsWarper`` cuts it); a row without takes the argmax of its logits (greedy, its log-prob at temperature
    1). Seeded rows are drawn in chunks of ``SAMPLE_CHUNK_VALUES`` values (each row's draw is its own, so the chunking
    changes no token); only the noise is gathered row by row."""
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
