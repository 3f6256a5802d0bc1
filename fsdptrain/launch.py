"""Start ranks: N local processes through torch's elastic launcher, or this process itself under torchrun.

The parent has already composed and validated the config; it writes the resolved YAML once and every rank loads that
file, so N ranks can never disagree about it or print N copies of one usage error.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")


def under_torchrun() -> bool:
    """True when this process is a rank started by torchrun (or any torch elastic agent)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def torchrun_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def launch_local(nproc: int, worker_args: list[str]) -> int:
    """Run ``python -m fsdptrain.worker *worker_args`` on ``nproc`` local ranks; return the first failing rank's code.

    Uses torch's elastic launcher with a standalone c10d rendezvous on localhost (what ``torchrun --standalone`` does)
    and no restarts: a rank that fails ends the run, and its exit code becomes the command's. Ctrl-C in a terminal
    reaches every rank directly (one process group), and each rank stops cleanly at the next step boundary; so this
    parent ignores SIGINT and leaves the ranks to finish, while SIGTERM still goes to the launcher, which passes it on.
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
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        elastic_launch(config, sys.executable)("-m", "fsdptrain.worker", *worker_args)
    except ChildFailedError as err:
        codes = [failure.exitcode for failure in err.failures.values()]
        positive = [code for code in codes if code > 0]
        return min(positive) if positive else 1
    except SignalException as err:
        return 128 + int(err.sigval)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0
