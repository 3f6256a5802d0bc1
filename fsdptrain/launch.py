"""Start ranks: N local processes through torch's elastic launcher, or this process itself under torchrun.

The parent has already composed and validated the config; it writes the resolved YAML once and every rank loads that
file, so N ranks can never disagree about it or print N copies of one usage error.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from fsdptrain.distributed.rank_errors import ERROR_DIR_ENV, PEER_LOST_EXIT, first_failure

LAUNCHER_PID_ENV = "FSDPTRAIN_LAUNCHER_PID"
"""The pid of the process that launched the ranks (set by :func:`launch_local`, read by each rank)."""
_PR_SET_PDEATHSIG = 1


def launch_local(nproc: int, worker_args: list[str]) -> int:
    """Run ``python -m fsdptrain.worker *worker_args`` on ``nproc`` local ranks; return the first failing rank's code.

    Uses torch's elastic launcher with a standalone c10d rendezvous on localhost (what ``torchrun --standalone`` does)
    and no restarts: a rank that fails ends the run, and its exit code becomes the command's. torch's launcher starts
    each rank in its own session, so a terminal's Ctrl-C reaches only this parent: it forwards every SIGINT and
    SIGTERM to the ranks (:func:`_forward_to_ranks`) and keeps waiting, so the ranks stop at the next step boundary
    (a second Ctrl-C: at once) and their exit codes decide the command's (0 after a clean stop). The agent itself
    handles only SIGHUP and SIGQUIT (it signals the ranks, waits briefly, then kills them).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Each rank prints its own reason for failing; the agent's per-rank error log would repeat it N times.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # inherited by the ranks: they die with this process
    previous = {sig: signal.signal(sig, _forward_to_ranks) for sig in (signal.SIGINT, signal.SIGTERM)}
    errors = tempfile.TemporaryDirectory(prefix="fsdptrain-errors-")
    os.environ[ERROR_DIR_ENV] = errors.name  # where a failing rank leaves its message (rank_errors.py)
    try:
        elastic_launch(config, sys.executable)("-m", "fsdptrain.worker", *worker_args)
    except ChildFailedError as err:
        return _report_first_failure(Path(errors.name), {f.local_rank: f.exitcode for f in err.failures.values()})
    except SignalException as err:
        failed = first_failure(Path(errors.name))  # e.g. a reward call abandoned after SIGTERM
        if failed is not None:
            print(failed[1], file=sys.stderr)
        return 128 + int(err.sigval)
    except _StoppedBeforeStart as err:
        return 128 + err.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del os.environ[ERROR_DIR_ENV]
        errors.cleanup()
    return 0


def _report_first_failure(errors: Path, codes: dict[int, int]) -> int:
    """Print the message of the first rank that reported one and return that rank's exit code; ranks that stopped
    only because of it (:data:`PEER_LOST_EXIT`, or killed by the launcher) are not reported. Without any report: the
    smallest positive exit code that is not collateral (a rank's own output already said why), else 1."""
    failed = first_failure(errors)
    if failed is not None:
        rank, text = failed
        print(text, file=sys.stderr)
        if codes.get(rank, 0) > 0:
            return codes[rank]
    own = [code for code in codes.values() if code > 0 and code != PEER_LOST_EXIT]
    return min(own) if own else 1


class _StoppedBeforeStart(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _forward_to_ranks(signum: int, _frame) -> None:
    """Pass SIGINT/SIGTERM on to the rank processes (this process's children); before any rank exists, stop now."""
    pids = _child_pids()
    if not pids:
        raise _StoppedBeforeStart(signum)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # a rank that has just exited
            pass


def _child_pids() -> list[int]:
    """The pids of this process's children: from /proc on Linux, else (or without /proc's children files) from
    ``pgrep -P``."""
    files = list(Path(f"/proc/{os.getpid()}/task").glob("*/children"))
    if files:
        pids = []
        for path in files:
            try:
                pids += [int(pid) for pid in path.read_text().split()]
            except OSError:  # a thread that has just ended
                pass
        return pids
    found = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process as soon as ``parent_pid`` (its launcher) ends, even by SIGKILL.

    torch's launcher starts ranks in sessions of their own, so nothing else stops them when the launcher is killed;
    they would keep writing the run directory. On Linux the kernel does it (``prctl(PR_SET_PDEATHSIG)``, tied to the
    launcher's main thread, which is the thread that starts the ranks); elsewhere a daemon thread polls the parent
    pid. A parent that died before this call is caught by the pid check.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            _watch_parent(parent_pid)
    else:
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fsdptrain-parent-watch", daemon=True).start()
