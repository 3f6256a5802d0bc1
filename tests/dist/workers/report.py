"""How a dist worker starts (``--out``, one thread, the gloo group) and the one way it leaves: write this rank's JSON
for the test, tear the group down, exit with the code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fsdptrain.distributed import world


def start_worker() -> tuple[Path, world.DistInfo]:
    """Parse ``--out``, run torch on one thread, join the CPU process group: ``(out_dir, this rank's world)``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    torch.set_num_threads(1)
    return out, world.init_distributed(device_type="cpu")


def report_and_exit(out_dir: str | Path, rank: int, record: dict, code: int) -> None:
    """``out_dir/rank<rank>.json`` holds ``record``; then the process group is destroyed and the process exits."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    world.destroy_distributed()
    world.exit_process(code)
