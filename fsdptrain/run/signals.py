"""Interruption: SIGTERM or Ctrl-C asks for a clean stop at the next step boundary; user code gets a bounded grace.

What a stop signal (SIGTERM, or a first Ctrl-C) does depends on where the run is (docs/checkpointing.md, "Stopping a
run"): while it generates, trains, evaluates or saves a checkpoint, it sets a flag; the ranks agree on it at the next
step boundary, save a checkpoint and exit 0. While the user's code runs (a reward, tool or environment call, in this
process, on the continuous engine's tool thread, or in workers: :func:`user_code`), the call has
:data:`USER_CODE_GRACE_S` seconds to return; if it has not by then, it is abandoned (workers are killed with their
process groups), nothing of the current step is saved (the last checkpoint stays) and the rank exits ``128 + signal``
with one line (:class:`StoppedInUserCode`). Should the user's code not even let Python take the signal (a C call that never returns), the process leaves through ``os._exit`` after
:data:`HARD_EXIT_S` more seconds. A second Ctrl-C stops at once, anywhere, without saving.

Processes that user code forks inherit no handler of ours (:func:`fsdptrain.rewards.pool.reset_signals_in_child`), so
a ``multiprocessing.Pool`` in a reward function can still terminate its processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator, Optional

from fsdptrain.distributed.rank_errors import another_rank_failed
from fsdptrain.rewards.pool import StopSignal, reset_signals_in_child
from fsdptrain.distributed.torchrun import env_rank

USER_CODE_GRACE_S = 10.0
"""Seconds a reward call may still run after a stop signal before it is abandoned."""
HARD_EXIT_S = 5.0
"""Seconds after the grace at which a rank whose user code blocks signals leaves through ``os._exit``."""

_fork_handler_registered = False


def log(message: str) -> None:
    """Print on rank 0 only (torch-free, so that this module stays light for the processes that import it)."""
    if env_rank() == 0:
        print(message, flush=True)


class StoppedInUserCode(StopSignal):
    """The user's code did not return within the grace after a stop signal; ``str()`` is the one line to print and
    :attr:`exit_code` is ``128 + signal``. A BaseException, so a user's ``except Exception`` does not swallow it, and
    a :class:`~fsdptrain.rewards.pool.StopSignal`, so the one place that calls user code lets it pass."""

    def __init__(self, signum: int, what: str, grace_s: float):
        super().__init__(f"{signal.Signals(signum).name}: {what} did not return within {grace_s:g} s of the signal; "
                         f"stopped without saving this step (the last checkpoint stays)")
        self.exit_code = 128 + signum


class StopAtOnce(KeyboardInterrupt, StopSignal):
    """A second Ctrl-C: stop at once, without saving (``KeyboardInterrupt``, told apart from one the user's code
    raises itself, which is that code's failure)."""


class StopRequest:
    """SIGTERM or Ctrl-C asks for a clean stop at the next step boundary; a second Ctrl-C stops at once; inside
    :meth:`user_code` the grace of the module docstring applies. :attr:`installed` is the one whose handlers are in
    place (None before :meth:`install`)."""

    installed: Optional[StopRequest] = None

    def __init__(self, grace_s: float = USER_CODE_GRACE_S, hard_exit_s: float = HARD_EXIT_S):
        self.requested = False
        self.grace_s, self.hard_exit_s = grace_s, hard_exit_s
        self._signum = signal.SIGTERM
        self._user_code: Optional[str] = None
        self._deadline: Optional[float] = None
        self._timer: Optional[threading.Thread] = None
        self._left = threading.Event()

    def install(self) -> None:
        global _fork_handler_registered
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        StopRequest.installed = self
        if not _fork_handler_registered:
            os.register_at_fork(after_in_child=reset_signals_in_child)
            _fork_handler_registered = True

    @contextlib.contextmanager
    def user_code(self, what: str) -> Iterator[None]:
        """A region where the user's code (``what``, e.g. "reward function 'f'") runs: a stop signal, before or
        during it, gives it :attr:`grace_s` seconds, then raises :class:`StoppedInUserCode` in the main thread."""
        self._user_code, self._left = what, threading.Event()
        if self.requested:
            self._arm()
        try:
            yield
        finally:
            self._left.set()
            self._user_code, self._deadline, self._timer = None, None, None

    def _handle(self, signum, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise StopAtOnce
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._left.set()
            raise StoppedInUserCode(self._signum, self._user_code or "the user's code", self.grace_s)
        if not self.requested and another_rank_failed():  # the launcher stopping this rank: the other one reports
            self.requested = True
            return
        if not self.requested:
            self._signum = signum
            running = "" if self._user_code is None else (
                f"; {self._user_code} is running: it has {self.grace_s:g} s to return, else the run stops without "
                "saving this step")
            log(f"{signal.Signals(signum).name}: stopping at the next step boundary after a checkpoint{running} "
                "(Ctrl-C again to stop at once, without saving)")
        self.requested = True
        if self._user_code is not None:
            self._arm()

    def _arm(self) -> None:
        """Start the grace timer (once per user-code region): at its end it signals the main thread, whose handler
        raises; if the handler cannot run, the process leaves after :attr:`hard_exit_s` more seconds."""
        if self._timer is not None:
            return
        self._deadline = time.monotonic() + self.grace_s
        left, main, what = self._left, threading.main_thread().ident, self._user_code

        def expire() -> None:
            if left.wait(self.grace_s):
                return
            signal.pthread_kill(main, signal.SIGTERM)  # interrupts a blocking wait or sleep in the main thread
            if not left.wait(self.hard_exit_s):
                log(f"{signal.Signals(self._signum).name}: {what} did not return and blocks signals; leaving now "
                    "without saving this step (the last checkpoint stays)")
                os._exit(128 + self._signum)

        self._timer = threading.Thread(target=expire, name="fsdptrain-stop-grace", daemon=True)
        self._timer.start()


def user_code(what: str):
    """:meth:`StopRequest.user_code` of the installed StopRequest; a plain region when none is installed (then the
    signals keep their default actions: SIGTERM ends the process, Ctrl-C raises KeyboardInterrupt)."""
    installed = StopRequest.installed
    return installed.user_code(what) if installed is not None else contextlib.nullcontext()
