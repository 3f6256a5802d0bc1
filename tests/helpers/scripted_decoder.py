"""Decoders for tests of the turn loop (fsdptrain/rollout/turns.py): a scripted one over a ``generate`` function,
and one over a given :class:`~fsdptrain.generation.continuous.ContinuousEngine` (to read its stats)."""

from __future__ import annotations

import contextlib
import itertools

from fsdptrain.generation.decoder import Sampling, decode_in_batches, generated_in_context
from fsdptrain.rollout.turns import run_turns

SAMPLING = Sampling("train", 1.0, 1.0)


class ScriptedDecoder:
    """A Decoder over ``generate(inputs, max_new_tokens, turn, samples) -> [(new_ids, ended_by_eos)]``: a decode
    call's requests in one batch, round by round (``turn`` the round), each input the request's whole context, each
    output cut to its request's cap (then not ended), as ``generate``'s decoder cuts it."""

    def __init__(self, generate):
        self.generate = generate

    def generating(self, *, uneven: bool = False):
        return contextlib.nullcontext()

    def decode(self, requests, sampling, *, on_finish=None):
        rounds = itertools.count()

        def batch(waiting):
            contexts = [list(r.kept or []) + list(r.new_ids) for r in waiting]
            outputs = self.generate(contexts, max(r.max_new_tokens for r in waiting), next(rounds),
                                    [r.key for r in waiting])
            return [generated_in_context(r, context, list(ids), ended)
                    for r, context, (ids, ended) in zip(waiting, contexts, outputs, strict=True)]

        return decode_in_batches(requests, on_finish, batch)


class EngineDecoder:
    """A Decoder running every call on one given continuous engine (its settings and stats are the test's)."""

    def __init__(self, engine):
        self.engine = engine

    def generating(self, *, uneven: bool = False):
        return contextlib.nullcontext()

    def decode(self, requests, sampling, *, on_finish=None):
        return self.engine.run(list(requests), on_finish)


def scripted_turns(chat, prompts, *, generate, call_tools, caps, seed=None):
    """``run_turns`` over :class:`ScriptedDecoder` (``generate``), or over a continuous engine (``generate`` a
    ContinuousEngine) with ``seed(sample, turn)`` as each turn's row seed."""
    decoder = EngineDecoder(generate) if hasattr(generate, "run") else ScriptedDecoder(generate)
    placement = (lambda s, t: (seed(s, t) if seed else None, None, None))
    return run_turns(decoder, SAMPLING, chat, prompts, placement=placement, call_tools=call_tools, caps=caps)
