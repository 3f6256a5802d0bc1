"""One message when a rank fails: the failing rank's own lines, never the other ranks' collateral errors.

When one rank of several fails (a reward function's bad value on its groups, a signal that abandoned its reward
call), the other ranks fail too, in the next collective, with gloo's ``Connection closed by peer``; and torch's
launcher stops them with SIGTERM. Under ``fsdptrain ... --nproc N`` (:func:`fsdptrain.launch.launch_local`) the ranks
therefore do not print the message of their failure: each writes it to a file of the launcher's error folder
(:func:`report_failure`), and the launcher prints the message of the first rank that wrote one and exits with that
rank's code. A rank whose collective failed because a peer is gone (:func:`peer_lost`) exits quietly with
:data:`PEER_LOST_EXIT`, which the launcher never reports. Without our launcher (one process, or torchrun), a rank
prints its message to stderr itself.

Torch-free: the CLI's parent (the launcher) imports it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

ERROR_DIR_ENV = "FSDPTRAIN_ERROR_DIR"
"""The folder where ranks started by :func:`fsdptrain.launch.launch_local` leave their failure messages."""
PEER_LOST_EXIT = 75
"""Exit code of a rank that stopped only because another rank failed (the launcher reports the other's)."""
_PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def report_failure(text: str, *, rank: int) -> None:
    """``text`` (the user's traceback, if any, and the one ``error:`` line) for the user: into the launcher's error
    folder when there is one, else to stderr."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder is not None:
        partial = Path(folder) / f".rank{rank}.partial"
        try:
            partial.write_text(f"{time.time()!r}\n{text}\n")
            partial.replace(Path(folder) / f"rank{rank}.txt")  # whole or absent: the launcher may read it any time
            return
        except OSError:  # a full disk, say: say it here rather than not at all
            pass
    print(text, file=sys.stderr)


def another_rank_failed() -> bool:
    """True once a rank of this launch has reported a failure (then a SIGTERM is the launcher stopping this rank)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    return folder is not None and any(Path(folder).glob("rank*.txt"))


def first_failure(folder: Path) -> Optional[tuple[int, str]]:
    """``(rank, text)`` of the earliest failure reported in ``folder``, or None when no rank reported one."""
    reports = []
    for path in folder.glob("rank*.txt"):
        stamp, _, text = path.read_text().partition("\n")
        reports.append((float(stamp), int(path.stem[4:]), text.rstrip("\n")))
    if not reports:
        return None
    _, rank, text = min(reports)
    return rank, text


def peer_lost(err: BaseException, depth: int = 0) -> bool:
    """True when ``err`` (or what caused it) is a collective failing because another rank's process is gone (only in
    a world of several ranks, as torch's launchers announce it in ``WORLD_SIZE``)."""
    if err is None or depth > 8 or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if isinstance(err, RuntimeError) and any(marker in str(err) for marker in _PEER_LOST_MARKERS):
        return True
    return any(peer_lost(e, depth + 1) for e in (err.__cause__, err.__context__) if e is not None)
