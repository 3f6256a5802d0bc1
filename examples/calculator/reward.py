"""Exact match: 1.0 when the final answer is exactly the product, else 0.0."""

from __future__ import annotations


def final_answer(completion) -> str:
    """The text of the last assistant turn: the completion itself (single-turn), or the last message of a
    multi-turn conversation when that is the assistant's (a trajectory cut after a tool call has no answer)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else {}
    return last["content"] if last.get("role") == "assistant" and not last.get("tool_calls") else ""


def exact_answer(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    return [float(final_answer(c).strip() == a) for c, a in zip(completions, answer)]
