"""Interruption: SIGTERM or Ctrl-C asks for a clean stop at the next step boundary (docs/checkpointing.md)."""

from __future__ import annotations

import signal

from fsdptrain.train.console import log


class StopRequest:
    """SIGTERM or Ctrl-C asks for a clean stop at the next step boundary; a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            log(f"{signal.Signals(signum).name}: stopping at the next step boundary after a checkpoint "
                "(Ctrl-C again to stop at once, without saving)")
        self.requested = True
