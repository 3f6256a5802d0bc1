"""The one place that runs the user's code (:func:`call_user_code`), and worker processes that run reward and tool
calls through it, each bounded by a timeout; a hung worker is killed and replaced.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one hung call (``cancel`` does nothing to a running
one, and terminating its processes means private attributes). Here each worker is a spawned process with its own pipe,
so the pool knows which process runs which call, kills exactly that one at its deadline and starts a fresh one.

Processes are started with ``spawn`` (never ``fork``: the parent holds torch, CUDA and NCCL state). A worker receives
the specs (reward functions, or tools) once and imports the functions itself (a ``path.py:function`` cannot be pickled by reference) when
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

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Iterator, Optional, Sequence

from fsdptrain.registry.user_functions import describe_exception

START_TIMEOUT_S = 300.0
"""Longest a reward worker may take to import the reward functions when it starts (docs/reward-functions.md)."""


@dataclass(frozen=True)
class Call:
    """One reward call: the function's position in the specs and its keyword arguments."""

    function: int
    kwargs: dict


@dataclass(frozen=True)
class Outcome:
    """What came back: ``status`` is ok (``values``), raised (an Exception: ``message`` and the user's
    ``traceback``), ended (the code tried to end its process: ``message`` says how), failed
    (``message``: not a list came back, or the worker died) or timeout. ``seconds``: how long the function ran (0.0
    for a timeout or a dead worker)."""

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


class StopSignal(BaseException):
    """Base of what the stop machinery raises (fsdptrain/run/signals.py: the end of a stop signal's grace, a second
    Ctrl-C): the one place that calls the user's code (:func:`call_user_code`) lets these, and only these, pass."""


class _ExitCalled(BaseException):
    """``os._exit(status)`` called by the user's code inside :func:`call_user_code` (raised instead of exiting)."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


_guarded = threading.local()
_real_exit = os._exit


def _exit_unless_guarded(status):
    """``os._exit`` while :func:`call_user_code` runs: in the thread (and process) running the user's call it raises
    :class:`_ExitCalled`; anywhere else (our own exits, a process the user's code forked) it exits."""
    if getattr(_guarded, "pid", None) == os.getpid():
        raise _ExitCalled(status)
    _real_exit(status)


@contextlib.contextmanager
def exits_raise_on_this_thread() -> Iterator[None]:
    """Within the block ``os._exit`` called on this thread raises, as inside :func:`call_user_code`: for a thread
    that runs user code on behalf of calls made on other threads (the agents' event loop, whose coroutines each
    ``call_user_code`` awaits: fsdptrain/rollout/agents.py). What the code raised reaches the awaiting call, which
    reports it as ``ended``."""
    if os._exit is not _exit_unless_guarded:
        os._exit = _exit_unless_guarded
    _guarded.pid = os.getpid()
    try:
        yield
    finally:
        _guarded.pid = None


def _is_stop(err: BaseException) -> bool:
    """Whether ``err`` comes from a stop signal rather than the user's code: ours (:class:`StopSignal`), or a
    KeyboardInterrupt in the main thread while SIGINT has Python's default handler (a real Ctrl-C; with our handler
    installed, or in a worker, which ignores SIGINT, or on another thread, a KeyboardInterrupt is the user's)."""
    if isinstance(err, StopSignal):
        return True
    return (isinstance(err, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def call_user_code(fn, kwargs: dict, *, then=None, timeout_s: Optional[float] = None) -> Outcome:
    """The one place where the user's code runs (reward functions, tools, environment methods; in this process and in
    workers): ``then(fn(**kwargs))`` (``then`` None: the result itself), and what happened as an :class:`Outcome`.

    ``ok``: ``values`` is what came back. ``raised``: an ``Exception`` (``message``, the user's ``traceback``).
    ``ended``: the code tried to end the process: ``sys.exit`` (any status, 0 included), ``os._exit`` (which raises
    here instead, in the calling thread), any other ``BaseException`` (a ``KeyboardInterrupt`` it raised itself
    included); ``message`` says which (no traceback: the one line is the report). Only a stop signal passes through
    (:func:`_is_stop`). ``timeout``: with ``timeout_s``, the call runs on a thread of its own and is abandoned at the
    deadline (a thread cannot be killed: it runs on until it returns or the process ends; code that may spin belongs
    in workers, which are killed); the wait for it is interruptible, so a stop signal's grace applies
    (docs/reward-functions.md)."""
    if timeout_s is None:
        return _call(fn, kwargs, then)
    box: list[Outcome] = []
    thread = threading.Thread(target=lambda: box.append(_call(fn, kwargs, then)), daemon=True,
                              name="fsdptrain-user-call")
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else Outcome("timeout")


def _call(fn, kwargs: dict, then) -> Outcome:
    if os._exit is not _exit_unless_guarded:
        os._exit = _exit_unless_guarded
    start = time.perf_counter()
    _guarded.pid = os.getpid()
    try:
        result = fn(**kwargs)
        values = result if then is None else then(result)
    except Exception as err:  # the user's exception, reported with their own traceback
        return Outcome("raised", message=describe_exception(err), traceback=user_traceback(err, skip=1),
                       seconds=time.perf_counter() - start)
    except BaseException as err:
        if _is_stop(err):
            raise
        if isinstance(err, _ExitCalled):
            how = f"called os._exit({err.status!r})"
        elif isinstance(err, SystemExit):
            how = f"raised SystemExit({err.code!r})"
        else:
            how = f"raised {describe_exception(err)} (a BaseException)"
        return Outcome("ended", message=how, seconds=time.perf_counter() - start)  # the line says all: no traceback
    finally:
        _guarded.pid = None
    return Outcome("ok", values=values, seconds=time.perf_counter() - start)


def run_call(fn, kwargs: dict, *, timeout_s: Optional[float] = None) -> Outcome:
    """A reward call through :func:`call_user_code`, its values made a list (numpy arrays and tensors become lists):
    an ``ok`` outcome whose result is not a list or tuple is ``failed``."""
    outcome = call_user_code(fn, kwargs, then=_as_list, timeout_s=timeout_s)
    if outcome.status == "ok" and not isinstance(outcome.values, (list, tuple)):
        return Outcome("failed", message=f"returned a {type(outcome.values).__name__}, not a list with one value "
                                         "per sample", seconds=outcome.seconds)
    return Outcome("ok", values=list(outcome.values), seconds=outcome.seconds) if outcome.status == "ok" else outcome


def _as_list(result):
    return result.tolist() if hasattr(result, "tolist") else result


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


def _worker_main(conn, specs: Sequence[str], parent_pid: int, run) -> None:
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
        outcome = run(functions[call.function], call.kwargs)
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
    """``num_workers`` spawned processes running calls of the functions ``specs`` names; see the module docstring for
    the life cycle. The constructor returns once every worker has imported them (or raises WorkerStartError).

    ``run(fn, kwargs) -> Outcome`` makes each call in the worker (a module-level function: it is sent by reference):
    :func:`run_call` for reward functions, the tools' own for tools; ``label`` ("reward", "tool") names the workers
    in messages."""

    def __init__(self, specs: Sequence[str], num_workers: int, *, start_timeout_s: float = START_TIMEOUT_S,
                 run=run_call, label: str = "reward"):
        assert num_workers >= 1
        self._specs = list(specs)
        self._run, self.label = run, label
        self._start_timeout_s = start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[Optional[_Worker]] = [None] * num_workers
        # close() may come from another thread than map()'s (the continuous engine's tool thread): once closed, no
        # replacement starts (a worker spawned as the process leaves would print the spawn's EOFError)
        self._lock, self._closed = threading.Lock(), False
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
        proc = self._ctx.Process(target=_worker_main, args=(child_conn, self._specs, os.getpid(), self._run),
                                 daemon=True, name=f"fsdptrain-{self.label}-{slot}")
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
                                       f"a {self.label} worker took longer than {self._start_timeout_s:g} s to import "
                                       f"{spec!r} (imports are bounded apart from reward.timeout_s)")

    def _take_start_message(self, slot: int) -> None:
        worker = self._workers[slot]
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.proc.join()
            raise WorkerStartError(worker.importing, f"a {self.label} worker died while importing "
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
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool was closed while a call ran")
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
                        results[index] = Outcome("failed", message=f"the {self.label} worker process died "
                                                                  f"(exit code {worker.proc.exitcode})")
                        self._replace(slot)
                    del busy[slot]
                elif time.monotonic() >= deadline:
                    results[index] = Outcome("timeout")
                    self._replace(slot)
                    del busy[slot]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Kill every worker with its process group and wait for it (idempotent; no replacement starts after it)."""
        with self._lock:
            self._closed = True
            for slot, worker in enumerate(self._workers):
                if worker is not None:
                    self._kill(slot)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
