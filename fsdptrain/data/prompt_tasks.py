"""The bundled digit tasks as prompt datasets: rows ``{"prompt", "answer"}`` for the ``word_match`` reward.

``repeat_digit`` ("repeat 7 =" -> "7 7 7"), ``copy_digits`` ("copy 3 1 4 =" -> "3 1 4"), ``reverse_digits``
("reverse 3 1 4 =" -> "4 1 3") and ``sort_digits`` ("sort 3 1 4 =" -> "1 3 4"). The ``answer`` column holds the
answer words joined by single spaces, so the reward ``word_match`` (:mod:`fsdptrain.rewards.builtin`) reproduces
the original digit-task reward (kept as the oracle in tests/helpers/digit_tasks_oracle.py) exactly: the share of answer
words the completion gets right position by position.

Departure from the old stream: rows are a finite, seeded list visited epoch by epoch
(:class:`fsdptrain.data.epoch_order.EpochOrder`), not a fresh random prompt per step; with 10 or 1000 possible prompts
per task, a few thousand rows cover every prompt many times.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from fsdptrain.config import ConfigError

DIGIT_TASKS: dict[str, tuple[int, Callable[[list[str]], list[str]]]] = {
    "repeat_digit": (1, lambda digits: [digits[0]] * 3),
    "copy_digits": (3, lambda digits: list(digits)),
    "reverse_digits": (3, lambda digits: digits[::-1]),
    "sort_digits": (3, lambda digits: sorted(digits)),
}
"""Task name -> (digits in the prompt, the answer words from the digits)."""


def digit_task_rows(task: str, *, num_rows: int, seed: int) -> list[dict]:
    """``num_rows`` rows of ``task``: a pure function of (task, num_rows, seed)."""
    if task not in DIGIT_TASKS:
        raise ConfigError(f"task={task!r} is not a bundled task; choose one of: {', '.join(DIGIT_TASKS)}")
    num_digits, answer_of = DIGIT_TASKS[task]
    verb = task.split("_")[0]
    rng = random.Random(f"{task}:{seed}")
    rows = []
    for _ in range(num_rows):
        digits = [str(rng.randrange(10)) for _ in range(num_digits)]
        rows.append({"prompt": f"{verb} {' '.join(digits)} =", "answer": " ".join(answer_of(digits))})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write ``rows`` one JSON object per line; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
