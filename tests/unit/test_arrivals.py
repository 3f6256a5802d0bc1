"""fsdptrain/generation/arrivals.py: resolved futures move to the waiting queue (a request, a list, None); an idle
engine takes a wave of arrivals together and stops at the first quiet gap."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque

from fsdptrain.generation.arrivals import gather_arrivals, take_resolved


def resolved(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def test_take_resolved_moves_requests_lists_and_drops_none_keeping_the_pending_ones():
    later = concurrent.futures.Future()
    pending = [resolved("a"), later, resolved(["b", "c"]), resolved(None)]
    waiting = deque(["x"])
    assert take_resolved(pending, waiting) == 3
    assert list(waiting) == ["x", "a", "b", "c"]
    assert pending == [later]


def resolve_at(schedule: list[tuple[float, concurrent.futures.Future, str]]) -> threading.Thread:
    def run():
        start = time.monotonic()
        for at, future, value in schedule:
            time.sleep(max(0.0, start + at - time.monotonic()))
            future.set_result(value)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_idle_engine_takes_the_wave_and_leaves_what_comes_after_a_quiet_gap():
    futures = [concurrent.futures.Future() for _ in range(4)]
    thread = resolve_at([(0.05, futures[0], "a"), (0.1, futures[1], "b"), (0.15, futures[2], "c"),
                         (2.0, futures[3], "late")])
    pending, waiting = list(futures), deque()
    gather_arrivals(pending, waiting, quiet_s=0.5, max_s=1.5)
    assert list(waiting) == ["a", "b", "c"]
    assert pending == [futures[3]]
    thread.join()


def test_gathering_ends_at_max_s_however_steady_the_arrivals():
    futures = [concurrent.futures.Future() for _ in range(6)]
    thread = resolve_at([(0.3 * i, f, str(i)) for i, f in enumerate(futures)])
    pending, waiting = list(futures), deque()
    gather_arrivals(pending, waiting, quiet_s=0.6, max_s=0.75)
    assert list(waiting) == ["0", "1", "2"]  # arrivals at 0.3 and 0.6 s; 0.9 s is past the 0.75 s bound
    assert len(pending) == 3
    thread.join()


def test_nothing_pending_returns_at_once():
    waiting = deque()
    gather_arrivals([], waiting)
    assert not waiting
