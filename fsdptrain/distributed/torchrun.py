"""Whether torchrun (or any torch elastic agent) started this process, read from the environment it sets.

Torch-free, so the CLI's parent process can ask before any rank starts; the process group reads the same answer.
"""

from __future__ import annotations

import os

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def under_torchrun() -> bool:
    """True when this process is a rank started by torchrun (every variable it sets is present)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def torchrun_world_size() -> int:
    """The world size torchrun announced (only meaningful under torchrun)."""
    return int(os.environ["WORLD_SIZE"])


def env_rank() -> int:
    """This process's global rank as the launcher announced it (0 when no launcher did), readable before the
    process group exists."""
    return int(os.environ.get("RANK", "0"))
