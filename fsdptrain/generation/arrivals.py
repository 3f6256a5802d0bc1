"""Requests that arrive as futures (the agents' endpoint, tools running): taking the resolved ones, and waiting for
a wave of them to arrive together.

A caller whose requests come from other threads (fsdptrain/rollout/endpoint.py: each agent's next request is a future
its HTTP request resolves) hands the engine futures. An idle engine that started on the first arrival would prefill
one row, then decode while the rest of the wave arrives a few at a time: many small forwards where one would do, and
prompts that several rows share seen apart. :func:`gather_arrivals` waits for the first arrival, then for as long as
arrivals keep coming less than ``quiet_s`` apart (at most ``max_s`` in all): the wave enters as one batch. What is
sampled does not depend on it (sampling is row-seeded, fsdptrain/generation/row_sampling.py); only when rows enter.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque

QUIET_S = 0.005
"""An idle engine stops gathering once no request arrived for this long."""
MAX_GATHER_S = 0.05
"""... or this long after the first arrival."""


def take_resolved(pending: list[concurrent.futures.Future], waiting: deque) -> int:
    """Move every resolved future of ``pending`` to ``waiting`` (its request, or each of its list; None adds
    nothing); how many futures resolved."""
    resolved = [f for f in pending if f.done()]
    for future in resolved:
        pending.remove(future)
        result = future.result()
        waiting.extend(r for r in (result if isinstance(result, list) else [result]) if r is not None)
    return len(resolved)


def gather_arrivals(pending: list[concurrent.futures.Future], waiting: deque, *, quiet_s: float = QUIET_S,
                    max_s: float = MAX_GATHER_S) -> None:
    """Block until a future of ``pending`` resolves, then take arrivals until none came for ``quiet_s`` or
    ``max_s`` passed since the first; resolved futures move to ``waiting`` (:func:`take_resolved`)."""
    if not pending:
        return
    concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
    deadline = time.monotonic() + max_s
    take_resolved(pending, waiting)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, _ = concurrent.futures.wait(pending, timeout=min(quiet_s, left),
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if not done:
            break
        take_resolved(pending, waiting)
