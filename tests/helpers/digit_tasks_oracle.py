"""The original built-in digit tasks, kept as an independent oracle for the tests: prompts made from a seed and the
positional word-match reward. The product now builds these tasks as prompt rows (fsdptrain/data/prompt_tasks.py).

Every task is a function of the prompt: the reward counts the response's words that match the prompt's answer position
by position, so it gives partial credit (a learning signal for a tiny model from the first step) and cannot be gamed by
length or by one favourite token (the right token changes with the prompt). Words past the answer's length are ignored;
missing words score 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Task:
    """A task: prompts ``"<verb> d1 .. dk ="`` of ``num_digits`` random digits, and the answer words they ask for."""

    name: str
    num_digits: int
    answer_of: Callable[[list[str]], list[str]]

    @property
    def verb(self) -> str:
        return self.name.split("_")[0]

    def make_prompt(self, rng: random.Random) -> tuple[str, list[str]]:
        digits = [str(rng.randrange(10)) for _ in range(self.num_digits)]
        return f"{self.verb} {' '.join(digits)} =", self.answer_of(digits)


def reward(response_text: str, answer: list[str]) -> float:
    """Fraction of the answer's positions the response gets right: ``sum_i [resp_i == ans_i] / len(ans)``."""
    words = response_text.split()
    hits = sum(1 for i, word in enumerate(answer) if i < len(words) and words[i] == word)
    return hits / len(answer)


TASKS: dict[str, Task] = {
    # The default: one digit, said three times. A tiny model learns it from scratch in a few minutes of PPO on a CPU,
    # and its reward still depends on the prompt (the right digit changes with it).
    "repeat_digit": Task("repeat_digit", 1, lambda d: d * 3),
    "copy_digits": Task("copy_digits", 3, lambda d: list(d)),
    "reverse_digits": Task("reverse_digits", 3, lambda d: list(reversed(d))),
    "sort_digits": Task("sort_digits", 3, lambda d: sorted(d)),
}


def answer_from_prompt(prompt_text: str, task: Task) -> list[str]:
    """Recompute the answer from a prompt's text (so stored rollouts can be re-rewarded)."""
    words = prompt_text.split()
    return task.answer_of(words[1:1 + task.num_digits])
