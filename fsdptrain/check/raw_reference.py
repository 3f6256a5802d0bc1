"""check-metrics, part 0: the reference's own inputs, from the raw generation output and the raw reward values.

Before any layout, the product cuts each response out of the tokens its decoder drew (``rollout.engine=generate``
or ``continuous``: fsdptrain/generation/decoder.py), decides which of its tokens the policy wrote, and adds the reward
functions' values up into one reward. Every layout is then fed the same result, so a bug in those stages cannot show as
a difference between layouts; the reference therefore redoes them itself, from their definitions, starting from what the
model and the user's functions returned (docs/check-metrics.md, "What the reference recomputes before the layouts"):

- prompt: the ids of the row's request as the sampler handed it to the decoder (recorded through the decoder's
  ``recording`` hook, before any padding);
- response: the tokens the decoder drew for the request, in order (``generate``: every new token of the row, the
  padding after its EOS included; the continuous engine: each token its sampler drew), up to and including the first
  EOS; a row with no EOS among them is truncated, and its response is all of them (at most
  ``rollout.max_new_tokens``);
- the policy's tokens: every response token of a single-turn sample, its EOS included (the check's multi-turn
  fixture mask where the check gave one);
- reward: ``sum_f w_f * v_f`` over the functions whose raw value ``v_f`` is a number (None is left out; 0.0 when no
  function applies), ``w_f`` the configured ``reward.weights`` (1.0 each when null), plus the reward models' scaled
  total.

Nothing here calls the product's ``split_response``, sampler, the decoder's ``Generated`` records, ``RewardRunner`` or
reward combination. Shared, because they are the inputs and not a stage: which tokens the engine drew (reported
through :class:`fsdptrain.generation.decoder.Recorder`), the tokenizer (the EOS id, the prompt's ids), the user's
reward functions (their values) and the reward models' scaled scores.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Optional, Sequence

from fsdptrain.check.compare import Check
from fsdptrain.generation.decoder import recording


@dataclass(frozen=True)
class RawSequence:
    """One sequence as the reference makes it: prompt and response ids, truncation, and the reward (None: the
    reference has no raw value to make it from)."""

    prompt_ids: list[int]
    response_ids: list[int]
    truncated: Optional[bool]
    """None: the engine's tokens end with neither EOS nor the cap, a cut no response can match."""
    reward: Optional[float]


@dataclass
class DecodeRun:
    """One ``decode`` call as the engine sampled it: the requests' keys and ids as the caller handed them (None for
    a request onto a kept context), every token the engine drew, per request key, in order, with its log-prob as the
    generating forward computed it (where the engine records them), and whether the caller could add requests
    (``on_finish``: a multi-turn sampler's later turns)."""

    keys: list[Hashable]
    prompts: list[Optional[list[int]]]
    follow_ups: bool
    sampled: dict[Hashable, list[int]] = field(default_factory=dict)
    logprobs: dict[Hashable, list[float]] = field(default_factory=dict)


class DecodeRecorder:
    """A :class:`fsdptrain.generation.decoder.Recorder` keeping every ``decode`` call as a :class:`DecodeRun`."""

    def __init__(self):
        self.runs: list[DecodeRun] = []

    def on_decode(self, requests, *, follow_ups: bool) -> None:
        self.runs.append(DecodeRun([r.key for r in requests],
                                   [list(r.new_ids) if r.kept is None else None for r in requests], follow_ups))

    def on_tokens(self, key, tokens, logprobs=None) -> None:
        self.runs[-1].sampled.setdefault(key, []).extend(int(t) for t in tokens)
        if logprobs is not None:
            self.runs[-1].logprobs.setdefault(key, []).extend(float(x) for x in logprobs)


@contextlib.contextmanager
def recording_decoders() -> Iterator[list[DecodeRun]]:
    """Within the block, every decoder's ``decode`` calls are recorded into the yielded list (the decoders'
    ``recording`` hook, fsdptrain/generation/decoder.py)."""
    recorder = DecodeRecorder()
    with recording(recorder):
        yield recorder.runs


def reference_prompt(input_ids: Sequence[int], attention_mask: Sequence[int]) -> list[int]:
    """The prompt's ids: those under a mask of 1."""
    return [int(token) for token, keep in zip(input_ids, attention_mask) if keep]


def reference_cut(new_tokens: Sequence[int], *, eos_id: int, max_new_tokens: int) -> tuple[list[int], bool]:
    """(response, truncated): ``new_tokens`` up to and including the first EOS, not truncated; without an EOS, the
    first ``max_new_tokens`` of them, truncated."""
    tokens = [int(t) for t in new_tokens]
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1], False
    return tokens[:max_new_tokens], True


def decoded_sequences(runs: Sequence[DecodeRun], rewards: Optional[list[Optional[float]]], num_rollouts: int,
                     *, eos_id: int, max_new_tokens: int) -> Optional[list[RawSequence]]:
    """This rank's sequences from one recorded ``decode`` call whose requests are its rollouts, in order (the
    single-turn sampler's training call); None when the runs are not that (none: offline data; several: not one
    single-turn batch; one that could add requests or whose requests continue a kept cache or
    share a key: a multi-turn sampler's). A request's tokens with no EOS and fewer than ``max_new_tokens`` of them
    end neither way: its ``truncated`` is None, so no product's response matches it."""
    if len(runs) != 1:
        return None
    run = runs[0]
    if (run.follow_ups or len(run.keys) != num_rollouts or len(set(run.keys)) != len(run.keys)
            or any(p is None for p in run.prompts)):
        return None
    out = []
    for row, (key, prompt) in enumerate(zip(run.keys, run.prompts)):
        response, truncated = reference_cut(run.sampled.get(key, []), eos_id=eos_id, max_new_tokens=max_new_tokens)
        if truncated and len(response) < max_new_tokens:  # the engine stopped with neither EOS nor the cap
            truncated = None
        out.append(RawSequence(list(prompt), response, truncated, None if rewards is None else rewards[row]))
    return out


def decoded_logprobs(runs: Sequence[DecodeRun], lengths: Sequence[int]) -> Optional[list[list[float]]]:
    """Per rollout, the generating forward's log-probs of its ``lengths[k]`` response tokens as the engine reported
    them, from the one recorded ``decode`` call whose requests are the rollouts, in order (the single-turn sampler's
    training call, as :func:`decoded_sequences` reads it); None when the runs are not that, or a request's recorded
    log-probs do not cover its response."""
    if len(runs) != 1 or runs[0].follow_ups or len(runs[0].keys) != len(lengths):
        return None
    run = runs[0]
    out = [run.logprobs.get(key, [])[:n] for key, n in zip(run.keys, lengths)]
    return out if all(len(x) == n for x, n in zip(out, lengths)) else None


def reference_reward(values: Sequence[Optional[float]], weights: Sequence[float]) -> float:
    """``sum_f w_f * v_f`` over the values that are numbers; 0.0 when none is."""
    total = 0.0
    for value, weight in zip(values, weights, strict=True):
        if value is not None:
            total += weight * float(value)
    return total


def reference_rewards(raw: dict[str, list[Optional[float]]], names: Sequence[str], weights: Sequence[float],
                      model_totals: Optional[Sequence[float]], num: int) -> list[float]:
    """Per sample, :func:`reference_reward` of the functions ``names`` (their raw values ``raw[name]``) with
    ``weights``, plus the reward models' total (``model_totals``; None: no reward model)."""
    out = []
    for k in range(num):
        total = reference_reward([raw[name][k] for name in names], weights)
        out.append(total + (float(model_totals[k]) if model_totals is not None else 0.0))
    return out


def raw_checks(product: Sequence[RawSequence], reference: Sequence[RawSequence], *, atol: float, rtol: float,
               responses_recut: bool) -> list[Check]:
    """The product's prompts, responses, truncation and rewards against the reference's (every rank's sequences):
    one check for the ids and truncation (exact; only when the reference cut them itself) and one for the rewards
    (``atol + rtol * |reference|``)."""
    checks = []
    if responses_recut:
        differ = [i for i, (p, r) in enumerate(zip(product, reference, strict=True))
                  if (p.prompt_ids, p.response_ids, p.truncated) != (r.prompt_ids, r.response_ids, r.truncated)]
        detail = f"{len(differ)} of {len(reference)} sequences differ"
        if differ:
            p, r = product[differ[0]], reference[differ[0]]
            detail += (f"; sequence {differ[0]}: response {p.response_ids} (truncated {p.truncated}), the cut of "
                       f"the raw generation {r.response_ids} (truncated {r.truncated})")
        checks.append(Check("experience: prompts and responses = the cut of the raw generation (EOS, "
                            "rollout.max_new_tokens)", "experience", float(len(differ)), not differ, detail))
    pairs = [(p.reward, r.reward) for p, r in zip(product, reference, strict=True) if r.reward is not None]
    if pairs:
        passed = all(abs(got - want) <= atol + rtol * abs(want) for got, want in pairs)  # a NaN fails
        got, want = max(pairs, key=lambda pair: math.inf if math.isnan(pair[0] - pair[1]) else abs(pair[0] - pair[1]))
        checks.append(Check("experience: rewards = the weighted raw reward values", "experience", abs(got - want),
                            passed, f"max |diff| {abs(got - want):.3g} (reward {got:.6g}, reference {want:.6g})"))
    return checks
