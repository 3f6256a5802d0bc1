"""Built-in reward functions, named in ``reward.functions`` by these names: exact_match, math, think_format, word_match.

Each has the signature every reward function has (TRL's): ``fn(prompts, completions, completion_ids, **columns)``
returning one score (or None: not applicable) per sample. The answer column is read as text: ``str(answer).strip()``,
so an int 7 and a string "7" are the same answer. ``None`` in the answer column makes the sample not applicable
(None), never a silent 0.

The *final answer* of a completion is the text after its last ``</think>`` when it has one, else the whole completion,
stripped of surrounding whitespace (:func:`final_answer`). A completion that opened ``<think>`` and never closed it has
no final answer: the empty string.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Optional

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def final_answer(completion: str) -> str:
    """The text after the last ``</think>`` (stripped); the whole completion if there is no think tag; "" for an
    unclosed ``<think>``."""
    if THINK_CLOSE in completion:
        return completion.rsplit(THINK_CLOSE, 1)[1].strip()
    if THINK_OPEN in completion:
        return ""
    return completion.strip()


def _answer_text(answer) -> Optional[str]:
    return None if answer is None else str(answer).strip()


def exact_match(prompts, completions, completion_ids, answer, **kwargs) -> list[Optional[float]]:
    """1.0 when the completion's final answer equals ``str(answer).strip()`` exactly (case and inner spaces count),
    else 0.0; None where the answer is None."""
    out = []
    for completion, gold in zip(completions, answer):
        gold_text = _answer_text(gold)
        out.append(None if gold_text is None else float(final_answer(completion) == gold_text))
    return out


def math_reward(prompts, completions, completion_ids, answer, **kwargs) -> list[Optional[float]]:
    """1.0 when math_verify finds the completion's final answer equal to the answer column, else 0.0.

    Both sides go through ``math_verify.parse`` (so ``\\boxed{1/2}``, ``0.5`` and ``\\frac{1}{2}`` agree) and are
    compared with ``math_verify.verify(gold, prediction)``. An answer math_verify cannot parse (or None) gives None,
    as TRL's accuracy reward does: the sample is not applicable rather than wrong. A completion with no parsable
    answer scores 0.0.
    """
    from math_verify import parse, verify

    out = []
    for completion, gold in zip(completions, answer):
        gold_text = _answer_text(gold)
        parsed_gold = parse(gold_text) if gold_text else []
        if not parsed_gold:
            out.append(None)
            continue
        prediction = final_answer(completion)
        parsed = parse(prediction) if prediction else []
        out.append(float(bool(parsed) and verify(parsed_gold, parsed)))
    return out


_THINK_FORMAT = re.compile(r"<think>(.*?)</think>(.*)", re.DOTALL)


def think_format(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """1.0 when the completion (surrounding whitespace ignored) is ``<think>...</think>`` then a non-empty answer,
    with exactly one ``<think>`` and one ``</think>`` (so no nested or repeated tags), else 0.0."""
    out = []
    for completion in completions:
        text = completion.strip()
        match = _THINK_FORMAT.fullmatch(text)
        ok = (match is not None and text.count(THINK_OPEN) == 1 and text.count(THINK_CLOSE) == 1
              and match.group(2).strip() != "")
        out.append(float(ok))
    return out


def word_match(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """Share of the answer's words the completion gets right position by position: ``sum_i [c_i == a_i] / len(a)``.

    Words are whitespace-split; completion words past the answer's length are ignored, missing ones score 0. This is
    the bundled digit tasks' reward (the default of ``reward.functions``) over an ``answer`` column of space-separated
    words.
    """
    out = []
    for completion, gold in zip(completions, answer):
        gold_words = str(gold).split()
        if not gold_words:
            raise ValueError(f"the answer {gold!r} has no words")
        words = completion.split()
        out.append(sum(1 for i, w in enumerate(gold_words) if i < len(words) and words[i] == w) / len(gold_words))
    return out


def _words(completion: str) -> str:
    return " ".join(completion.split())


ANSWER_OF = {"exact_match": final_answer, "math": final_answer, "word_match": _words}
"""The built-ins whose score is a function of one view of the completion alone (given the row's answer): that view.
exact_match and math read the final answer; word_match the completion's whitespace-separated words."""


def comparable_answers(completions: Sequence[str], reward_specs: Sequence[str], *,
                       num_reward_models: int) -> Optional[list[str]]:
    """The answer each completion votes with in a majority vote (eval/maj@n, docs/evaluation.md), compared as text:
    the view :data:`ANSWER_OF` gives for each configured reward (several rewards: the views joined by newlines).
    Two completions with the same answer then get the same total reward, so the majority answer's reward is well
    defined. None (no vote) when any reward is not in :data:`ANSWER_OF` (a user's function, ``think_format``) or a
    reward model scores too: those read more than the answer."""
    if num_reward_models or not reward_specs or any(spec not in ANSWER_OF for spec in reward_specs):
        return None
    views = [ANSWER_OF[spec] for spec in dict.fromkeys(reward_specs)]
    return ["\n".join(view(completion) for view in views) for completion in completions]


BUILTINS = {"exact_match": exact_match, "math": math_reward, "think_format": think_format, "word_match": word_match}
"""Reward functions usable by name in ``reward.functions``."""

REQUIREMENTS = {"math": ("math_verify", "fsdptrain[math]")}
"""Built-ins that need an optional package: name -> (module to import, what to pip install)."""
