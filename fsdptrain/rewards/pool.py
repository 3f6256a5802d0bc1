"""Worker processes that run reward calls, each bounded by a timeout; a hung worker is killed and replaced.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one hung call (``cancel`` does nothing to a running
one, and terminating its processes means private attributes). Here each worker is a spawned process with its own pipe,
so the pool knows which process runs which call, kills exactly that one at its deadline and starts a fresh one.

Processes are started with ``spawn`` (never ``fork``: the parent holds torch, CUDA and NCCL state). A worker receives
the reward specs once and loads the functions itself (a ``path.py:function`` cannot be pickled by reference), ignores
SIGINT (Ctrl-C reaches the whole process group; the parent decides), and exits when its parent does: on EOF of its
pipe, and from a watchdog thread when the parent process id changes (the parent may leave through ``os._exit``, which
runs no atexit handler, or be killed). :meth:`WorkerPool.close` kills every worker and waits for it; ``map`` closes the
pool itself if anything (Ctrl-C included) interrupts it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Optional, Sequence


@dataclass(frozen=True)
class Call:
    """One reward call: the function's position in the specs and its keyword arguments."""

    function: int
    kwargs: dict


@dataclass(frozen=True)
class Outcome:
    """What came back: ``status`` is ok (``values``, a list), raised (``message`` and the user's ``traceback``),
    failed (``message``: not a list came back, or the worker died) or timeout."""

    status: str
    values: object = None
    message: str = ""
    traceback: str = ""


def user_traceback(err: BaseException, *, skip: int) -> str:
    """The traceback text of ``err`` without its first ``skip`` frames (ours), so the user reads their own code."""
    tb = err.__traceback__
    for _ in range(skip):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


def run_call(fn, kwargs: dict) -> Outcome:
    """Call ``fn(**kwargs)`` and wrap what happens in an Outcome (KeyboardInterrupt and SystemExit pass through)."""
    try:
        result = fn(**kwargs)
    except Exception as err:  # the user's exception, reported with their own traceback
        return Outcome("raised", message=f"{type(err).__name__}: {err}", traceback=user_traceback(err, skip=1))
    values = result.tolist() if hasattr(result, "tolist") else result  # numpy arrays and tensors become lists
    if not isinstance(values, (list, tuple)):
        return Outcome("failed", message=f"returned a {type(result).__name__}, not a list with one value per sample")
    return Outcome("ok", values=list(values))


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def _worker_main(conn, specs: Sequence[str], parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from fsdptrain.rewards.loading import resolve

    functions = [resolve(s) for s in specs]
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if call is None:
            return
        outcome = run_call(functions[call.function], call.kwargs)
        try:
            conn.send(outcome)
        except Exception as err:  # values that do not pickle
            conn.send(Outcome("failed", message=f"returned values that cannot be sent back ({err})"))


class WorkerPool:
    """``num_workers`` spawned processes running reward calls; see the module docstring for the life cycle."""

    def __init__(self, specs: Sequence[str], num_workers: int):
        assert num_workers >= 1
        self._specs = list(specs)
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[Optional[tuple]] = [None] * num_workers
        for slot in range(num_workers):
            self._start(slot)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (tests use them to check nothing is left behind)."""
        return [w[0].pid for w in self._workers if w is not None]

    def _start(self, slot: int) -> None:
        parent_conn, child_conn = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child_conn, self._specs, os.getpid()), daemon=True,
                                 name=f"fsdptrain-reward-{slot}")
        proc.start()
        child_conn.close()
        self._workers[slot] = (proc, parent_conn)

    def _kill(self, slot: int) -> None:
        proc, conn = self._workers[slot]
        proc.kill()
        proc.join()
        conn.close()
        self._workers[slot] = None

    def map(self, calls: Sequence[Call], *, timeout_s: Optional[float]) -> list[Outcome]:
        """One outcome per call, in order. A call running past ``timeout_s`` is a timeout and its worker is replaced;
        a worker that dies mid-call is an error. Any exception here (KeyboardInterrupt included) closes the pool."""
        try:
            return self._map(calls, timeout_s)
        except BaseException:
            self.close()
            raise

    def _map(self, calls: Sequence[Call], timeout_s: Optional[float]) -> list[Outcome]:
        results: list[Optional[Outcome]] = [None] * len(calls)
        todo = list(range(len(calls)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # slot -> (call index, deadline)
        while todo or busy:
            for slot in range(len(self._workers)):
                if slot not in busy and todo:
                    index = todo.pop()
                    self._workers[slot][1].send(calls[index])
                    busy[slot] = (index, time.monotonic() + timeout_s if timeout_s else float("inf"))
            next_deadline = min(deadline for _, deadline in busy.values())
            wait_s = None if next_deadline == float("inf") else max(next_deadline - time.monotonic(), 0.0)
            ready = wait([self._workers[slot][1] for slot in busy], timeout=wait_s)
            for slot in list(busy):
                index, deadline = busy[slot]
                proc, conn = self._workers[slot]
                if conn in ready:
                    try:
                        results[index] = conn.recv()
                    except (EOFError, OSError):
                        proc.join()
                        results[index] = Outcome("failed", message=f"the reward worker process died "
                                                                  f"(exit code {proc.exitcode})")
                        self._kill(slot)
                        self._start(slot)
                    del busy[slot]
                elif time.monotonic() >= deadline:
                    results[index] = Outcome("timeout")
                    self._kill(slot)
                    self._start(slot)
                    del busy[slot]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Kill every worker and wait for it (idempotent)."""
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                self._kill(slot)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
