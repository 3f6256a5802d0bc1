"""The seam between what asks for tokens and what samples them: :class:`Decoder` (docs/architecture.md, "The
generation room and its seam").

A caller (a rollout sampler today; a generator rank or an HTTP endpoint behind the same records tomorrow) hands a
decoder :class:`Request` records and gets :class:`Generated` records back, in the order the requests finished. It
never names an engine: ``make_decoder`` picks one once from ``rollout.engine``
(fsdptrain/generation/engines.py):

- ``continuous`` (:class:`fsdptrain.generation.continuous.ContinuousEngine`): every request in one decode loop, each
  row drawn from its own generator (``Request.seed``), a turn continued onto its kept cache;
- ``generate`` (:class:`fsdptrain.generation.generate.GenerateDecoder`): transformers' ``generate``, the requests
  of one ``Request.batch`` in one padded call drawn from one generator (``Request.batch_seed``; row seeds in the
  sampled evaluation), a turn continued by prefilling its whole context again.

**Turns.** A request with ``keep`` hands back, in ``Generated.kept``, what continues it (a cache, or the context's
ids: opaque to the caller); a follow-up request passes it as ``kept`` with only the new ids (the last sampled token,
then whatever the caller appends). ``on_finish(generated)`` returns the follow-ups, or futures of them (tools running
while other rows decode).

**Recording.** Inside ``with recording(recorder):`` every decoder reports each ``decode`` call as handed to it and
every token it draws with its log-prob, by request key (:class:`Recorder`). check-metrics cuts its own responses
from these and compares the behaviour log-probs with them (fsdptrain/check/raw_reference.py); nothing replaces an
engine's method to see them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Callable, ContextManager, Hashable, Iterable, Iterator, Literal, Optional, Protocol,
                    Sequence, Union)

if TYPE_CHECKING:
    import torch

SampleMode = Literal["train", "greedy", "eval"]
"""``train``: sampled at ``rollout.temperature`` / ``rollout.top_p`` from the step's seeds; ``greedy``: the greedy
evaluation; ``eval``: the sampled evaluation (docs/evaluation.md), each sample drawn at ``trainer.eval_temperature``
from its own generator, seeded by (``trainer.seed``, step, prompt, sample) only."""


@dataclass(frozen=True)
class Sampling:
    """How one call's tokens are drawn: the mode, its temperature and top-p (:func:`sampling_for`), and how many
    samples each prompt has in the call (the same on every rank: ``generate`` prefills a repeated prompt once)."""

    mode: SampleMode
    temperature: float
    top_p: float
    repeat: int = 1


def sampling_for(cfg, mode: SampleMode, *, repeat: int = 1) -> Sampling:
    """The one temperature rule: training samples at ``rollout.temperature`` and ``rollout.top_p``; the sampled
    evaluation at ``trainer.eval_temperature`` with top-p 1; greedy decoding takes the argmax (its log-probs, where
    recorded, at temperature 1)."""
    if mode == "train":
        return Sampling(mode, cfg.rollout.temperature, cfg.rollout.top_p, repeat)
    if mode == "eval":
        return Sampling(mode, cfg.trainer.eval_temperature, 1.0, repeat)
    return Sampling(mode, 1.0, 1.0, repeat)


@dataclass
class Request:
    """One turn of one trajectory: ``new_ids`` to prefill (the whole prompt, or onto ``kept``: only what follows the
    kept context), at most ``max_new_tokens`` to sample. ``seed``: the row's own generator (None: greedy, or drawn
    from the batch's); ``batch`` / ``batch_seed``: an engine that draws a batch from one generator (``generate``)
    decodes the requests of one ``batch`` together from ``batch_seed`` (a row-seeded engine ignores both). ``keep``:
    hand back what continues the turn. The continuous engine sets ``kept`` to None once it holds that cache."""

    key: Hashable
    new_ids: list[int]
    max_new_tokens: int
    seed: Optional[int] = None
    kept: Optional[object] = None
    keep: bool = False
    batch: Hashable = None
    batch_seed: Optional[int] = None


@dataclass
class Generated:
    """A request's sampled ids (EOS included when it ended on one; never more than its ``max_new_tokens``), their
    behaviour log-probs (``log_softmax(logits / temperature)`` of the generating forward: after temperature, before
    top-p; empty where the engine did not record them), whether it ended on EOS (not its cap), and (``keep``) what
    continues it."""

    key: Hashable
    new_ids: list[int]
    logprobs: list[float]
    ended: bool
    kept: Optional[object] = None
    routes: Optional["torch.Tensor"] = None
    """A mixture-of-experts policy's training rollouts: ``[L, n, k]`` small ints on the CPU, the experts each MoE
    layer chose for the tokens this request's forwards read (its ``new_ids``, then every sampled id but the last:
    fsdptrain/generation/routes.py); None where the engine did not record them."""

    @property
    def truncated(self) -> bool:
        return not self.ended


OnFinish = Callable[[list[Generated]], Iterable[Union[Request, "concurrent.futures.Future"]]]
"""``on_finish(generated) -> follow-ups``: requests, or futures each of a request, a list of them or None."""


class Decoder(Protocol):
    """Turns requests into sampled tokens; see the module docstring."""

    def generating(self, *, uneven: bool = False) -> ContextManager[None]:
        """The block every ``decode`` runs in (collective: every rank enters it): the ``generate`` phase, sdpa, the
        policy's weights gathered as ``rollout.gather_weights`` says. ``uneven``: ranks make different numbers of
        calls (multi-turn), so the weights must be gathered (fsdptrain/generation/block.py)."""

    def decode(self, requests: Sequence[Request], sampling: Sampling, *,
               on_finish: Optional[OnFinish] = None) -> list[Generated]:
        """``requests`` and every follow-up ``on_finish`` adds, decoded; the generated ones in the order they left.
        A row-seeded engine (``continuous``) also takes futures among ``requests``, resolved as follow-ups are: a
        caller whose requests arrive while others decode (the OpenAI endpoint, fsdptrain/rollout/endpoint.py)."""


class Recorder(Protocol):
    """What a checker sees of decoding (:func:`recording`)."""

    def on_decode(self, requests: Sequence[Request], *, follow_ups: bool) -> None:
        """A ``decode`` call's requests as the caller handed them; ``follow_ups``: the caller may add more."""

    def on_tokens(self, key: Hashable, tokens: Sequence[int], logprobs: Optional[Sequence[float]] = None) -> None:
        """Tokens the engine drew for request ``key``, in order (before any cut at EOS), and each one's log-prob as
        the generating forward computed it (``Generated.logprobs``' rule; None where the engine records none)."""


_RECORDER: contextvars.ContextVar[Optional[Recorder]] = contextvars.ContextVar("fsdptrain_decode_recorder",
                                                                               default=None)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Within the block, every decoder reports to ``recorder`` (see :class:`Recorder`)."""
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def active_recorder() -> Optional[Recorder]:
    """The recorder of the innermost :func:`recording` block; None outside one."""
    return _RECORDER.get()


def generated_in_context(request: Request, context: list[int], new_ids: list[int], ended: bool,
                         logprobs: Sequence[float] = (), routes: Optional["torch.Tensor"] = None) -> Generated:
    """A batching engine's record of one request decoded on its whole ``context`` (the kept ids, then the request's
    new ones): ``new_ids`` cut to the request's cap (then not ended, though the call's larger cap let it go on),
    the log-probs and the ``routes`` (``[L, n, k]`` from the request's new ids on) cut alike, and (``keep``) the
    context with the new ids but the last as what continues it."""
    if len(new_ids) > request.max_new_tokens:
        new_ids, ended = new_ids[:request.max_new_tokens], False
    if routes is not None:
        routes = routes[:, :len(request.new_ids) + max(len(new_ids) - 1, 0)]
    return Generated(request.key, list(new_ids), list(logprobs[:len(new_ids)]), ended,
                     kept=context + new_ids[:-1] if request.keep else None, routes=routes)


def decode_in_batches(requests: Sequence[Request], on_finish: Optional[OnFinish],
                      generate_batch: Callable[[list[Request]], list[Generated]]) -> list[Generated]:
    """The ``decode`` of an engine that draws a batch from one generator: the requests of each ``Request.batch``, in
    the order first handed, round by round. A round is one ``generate_batch`` of the batch's waiting requests; the
    follow-ups ``on_finish`` returns for them (futures waited for) are its next round, so a batch's turns run in step
    and one batch's last turn ends before the next batch starts."""
    done: list[Generated] = []
    for batch in dict.fromkeys(r.batch for r in requests):
        waiting = [r for r in requests if r.batch == batch]
        while waiting:
            generated = generate_batch(waiting)
            if on_finish is None:
                done.extend(generated)
                break
            # the kept contexts go to on_finish only, as the continuous engine hands them
            done.extend(dataclasses.replace(g, kept=None) for g in generated)
            waiting = _resolved(on_finish(generated))
            if any(r.batch != batch for r in waiting):
                raise ValueError("a follow-up request must stay in its request's batch")
    return done


def _resolved(follow_ups: Iterable) -> list[Request]:
    out: list[Request] = []
    for follow in follow_ups:
        result = follow.result() if isinstance(follow, concurrent.futures.Future) else follow
        out.extend(r for r in (result if isinstance(result, list) else [result]) if r is not None)
    return out
