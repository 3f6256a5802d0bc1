"""check-metrics' progress lines: ``check-metrics [i/N] <pass> (<seconds> s)`` on rank 0 as each pass finishes.

A check on a real model runs for minutes; these lines say which pass (a layout, the reference, a stage) just ended,
how long it took and how many are left, as ``fsdptrain train`` shows its steps (docs/check-metrics.md). After each
pass the memory it freed is handed back to the system (:func:`fsdptrain.run.malloc.release_freed_memory`).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from fsdptrain.distributed import world
from fsdptrain.run.malloc import release_freed_memory

T = TypeVar("T")


def say(message: str) -> None:
    """One line on rank 0, flushed at once (the launcher forwards rank 0's stdout as it comes)."""
    if world.rank() == 0:
        print(message, flush=True)


class Progress:
    """Counts the passes of one check: ``total`` planned, each announced when it ends with its own seconds."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0

    def run(self, name: str, work: Callable[[], T]) -> T:
        """Run ``work`` (one pass), then print its line; the line is printed even when ``work`` raises."""
        start = time.perf_counter()
        try:
            return work()
        finally:
            release_freed_memory()
            self.done += 1
            say(f"check-metrics [{self.done}/{max(self.total, self.done)}] {name} "
                f"({time.perf_counter() - start:.1f} s)")
