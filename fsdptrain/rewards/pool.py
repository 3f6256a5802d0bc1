"""Worker processes that run reward calls, each bounded by a timeout; a hung worker is killed and replaced.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one hung call (``cancel`` does nothing to a running
one, and terminating its processes means private attributes). Here each worker is a spawned process with its own pipe,
so the pool knows which process runs which call, kills exactly that one at its deadline and starts a fresh one.

Processes are started with ``spawn`` (never ``fork``: the parent holds torch, CUDA and NCCL state). A worker receives
the reward specs once and imports the functions itself (a ``path.py:function`` cannot be pickled by reference) when
it starts, before it takes any call: it reports ``ready``, and the pool sends it calls only then, so a slow import
never counts against a call's deadline. Start-up has its own bound (``start_timeout_s``, :data:`START_TIMEOUT_S` by
default); a worker that has not finished importing by then, or whose import fails, is a :class:`WorkerStartError`
naming the spec. Each worker leads a process group of its own (``os.setsid``), and is killed with its whole group
(``killpg``, SIGKILL), so processes the user's function started (a ``multiprocessing.Pool``, a subprocess) go with it,
unless they left the group themselves. A worker ignores SIGINT (the parent decides) and exits, with its group, when
its parent does: on EOF of its pipe, and from a watchdog thread when the parent process id changes (the parent may
leave through ``os._exit``, which runs no atexit handler, or be killed). :meth:`WorkerPool.close` kills every worker
and waits for it; ``map`` closes the pool itself if anything (Ctrl-C, a stop signal) interrupts it.
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

from fsdptrain.registry.user_functions import describe_exception

START_TIMEOUT_S = 300.0
"""Longest a reward worker may take to import the reward functions when it starts (docs/your-task.md)."""


@dataclass(frozen=True)
class Call:
    """One reward call: the function's position in the specs and its keyword arguments."""

    function: int
    kwargs: dict


@dataclass(frozen=True)
class Outcome:
    """What came back: ``status`` is ok (``values``, a list), raised (``message`` and the user's ``traceback``),
    failed (``message``: not a list came back, or the worker died) or timeout. ``seconds``: how long the function ran
    (0.0 for a timeout or a dead worker)."""

    status: str
    values: object = None
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0


class WorkerStartError(RuntimeError):
    """A worker could not import reward function ``function`` (its position in the specs): ``str()`` is one line."""

    def __init__(self, function: int, message: str):
        super().__init__(message)
        self.function = function


def user_traceback(err: BaseException, *, skip: int) -> str:
    """The traceback text of ``err`` without its first ``skip`` frames (ours), so the user reads their own code."""
    tb = err.__traceback__
    for _ in range(skip):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


def run_call(fn, kwargs: dict) -> Outcome:
    """Call ``fn(**kwargs)`` and wrap what happens in an Outcome. The user's exception and ``sys.exit()`` are a
    "raised" outcome; KeyboardInterrupt and other BaseExceptions (a stop signal) pass through."""
    start = time.perf_counter()
    try:
        result = fn(**kwargs)
        values = result.tolist() if hasattr(result, "tolist") else result  # numpy arrays and tensors become lists
    except SystemExit as err:  # would end the run without a word
        return Outcome("raised", message=f"SystemExit({err.code!r}) (a reward function returns its values; it must "
                                         "not exit)", traceback=user_traceback(err, skip=1),
                       seconds=time.perf_counter() - start)
    except Exception as err:  # the user's exception, reported with their own traceback
        return Outcome("raised", message=describe_exception(err), traceback=user_traceback(err, skip=1),
                       seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if not isinstance(values, (list, tuple)):
        return Outcome("failed", message=f"returned a {type(result).__name__}, not a list with one value per sample",
                       seconds=seconds)
    return Outcome("ok", values=list(values), seconds=seconds)


def reset_signals_in_child() -> None:
    """Give a process forked from this one the signal handlers of a fresh Python (SIGTERM: the default action,
    SIGINT: KeyboardInterrupt), so that a ``multiprocessing.Pool`` a reward function forks can terminate its own
    processes; register with ``os.register_at_fork(after_in_child=...)``."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread of the child: leave it be
        pass


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            _kill_own_group()
        time.sleep(0.5)


def _kill_own_group() -> None:
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)  # this worker leads its group: itself and what it started
    finally:
        os._exit(0)


def _worker_main(conn, specs: Sequence[str], parent_pid: int) -> None:
    os.setsid()  # a group of its own, killed as one (module docstring)
    # Daemonic only for the parent's bookkeeping: the user's function may start processes (a multiprocessing.Pool),
    # which multiprocessing refuses to a daemonic process; they end with this worker's group.
    multiprocessing.current_process().daemon = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from fsdptrain.registry.errors import ConfigError
    from fsdptrain.rewards.loading import resolve

    functions = []
    for k, spec in enumerate(specs):
        conn.send(("importing", k))
        try:
            functions.append(resolve(spec))
        except ConfigError as err:
            conn.send(("import-failed", k, str(err)))
            return
    conn.send(("ready",))
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


@dataclass
class _Worker:
    proc: multiprocessing.process.BaseProcess
    conn: object
    start_deadline: float
    importing: int = 0
    ready: bool = False


class WorkerPool:
    """``num_workers`` spawned processes running reward calls; see the module docstring for the life cycle. The
    constructor returns once every worker has imported the functions (or raises WorkerStartError)."""

    def __init__(self, specs: Sequence[str], num_workers: int, *, start_timeout_s: float = START_TIMEOUT_S):
        assert num_workers >= 1
        self._specs = list(specs)
        self._start_timeout_s = start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[Optional[_Worker]] = [None] * num_workers
        try:
            for slot in range(num_workers):
                self._start(slot)
            while not all(w.ready for w in self._workers):
                self._wait_for_start([slot for slot, w in enumerate(self._workers) if not w.ready])
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (tests use them to check nothing is left behind)."""
        return [w.proc.pid for w in self._workers if w is not None]

    def _start(self, slot: int) -> None:
        parent_conn, child_conn = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child_conn, self._specs, os.getpid()), daemon=True,
                                 name=f"fsdptrain-reward-{slot}")
        proc.start()
        child_conn.close()
        self._workers[slot] = _Worker(proc, parent_conn, time.monotonic() + self._start_timeout_s)

    def _wait_for_start(self, slots: list[int]) -> None:
        """Take the start-up messages of the workers in ``slots`` that arrive before the first start deadline."""
        deadline = min(self._workers[slot].start_deadline for slot in slots)
        ready = wait([self._workers[slot].conn for slot in slots], timeout=max(deadline - time.monotonic(), 0.0))
        for slot in slots:
            if self._workers[slot].conn in ready:
                self._take_start_message(slot)
            elif time.monotonic() >= self._workers[slot].start_deadline:
                spec = self._specs[self._workers[slot].importing]
                raise WorkerStartError(self._workers[slot].importing,
                                       f"a reward worker took longer than {self._start_timeout_s:g} s to import "
                                       f"{spec!r} (imports are bounded apart from reward.timeout_s)")

    def _take_start_message(self, slot: int) -> None:
        worker = self._workers[slot]
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.proc.join()
            raise WorkerStartError(worker.importing, f"a reward worker died while importing "
                                                     f"{self._specs[worker.importing]!r} (exit code "
                                                     f"{worker.proc.exitcode})") from None
        if message[0] == "importing":
            worker.importing = message[1]
        elif message[0] == "import-failed":
            raise WorkerStartError(message[1], message[2])
        else:
            worker.ready = True

    def _kill(self, slot: int) -> None:
        worker = self._workers[slot]
        try:  # the worker's group: itself and every process it started (module docstring)
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # it has not called setsid yet, or is gone
            worker.proc.kill()
        worker.proc.join()
        worker.conn.close()
        self._workers[slot] = None

    def _replace(self, slot: int) -> None:
        self._kill(slot)
        self._start(slot)

    def map(self, calls: Sequence[Call], *, timeout_s: Optional[float]) -> list[Outcome]:
        """One outcome per call, in order. A call running past ``timeout_s`` is a timeout and its worker is replaced
        (the replacement imports before its first call, outside any call's deadline); a worker that dies mid-call is
        an error. Any exception here (KeyboardInterrupt, WorkerStartError included) closes the pool."""
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
            for slot, worker in enumerate(self._workers):
                if worker.ready and slot not in busy and todo:
                    index = todo.pop()
                    worker.conn.send(calls[index])
                    busy[slot] = (index, time.monotonic() + timeout_s if timeout_s else float("inf"))
            starting = [slot for slot, w in enumerate(self._workers) if not w.ready]
            deadlines = [d for _, d in busy.values()] + [self._workers[slot].start_deadline for slot in starting]
            next_deadline = min(deadlines)
            wait_s = None if next_deadline == float("inf") else max(next_deadline - time.monotonic(), 0.0)
            ready = wait([self._workers[slot].conn for slot in [*busy, *starting]], timeout=wait_s)
            for slot in starting:
                if self._workers[slot].conn in ready:
                    self._take_start_message(slot)
                elif time.monotonic() >= self._workers[slot].start_deadline:
                    self._wait_for_start([slot])  # raises WorkerStartError
            for slot in list(busy):
                index, deadline = busy[slot]
                worker = self._workers[slot]
                if worker.conn in ready:
                    try:
                        results[index] = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.proc.join()
                        results[index] = Outcome("failed", message=f"the reward worker process died "
                                                                  f"(exit code {worker.proc.exitcode})")
                        self._replace(slot)
                    del busy[slot]
                elif time.monotonic() >= deadline:
                    results[index] = Outcome("timeout")
                    self._replace(slot)
                    del busy[slot]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Kill every worker with its process group and wait for it (idempotent)."""
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                self._kill(slot)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
