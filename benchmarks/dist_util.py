"""Helpers for benchmarks that run on several gloo ranks: relaunch a script under torchrun, collect rank 0's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def launch(script: str, nproc: int, args: list[str], *, threads: int = 1) -> dict:
    """Run ``script --worker ARGS`` on ``nproc`` gloo ranks (a plain process for 1); rank 0's last stdout line, JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(threads)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*(launcher if nproc > 1 else [sys.executable]), script, "--worker", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{script} at {nproc} rank(s) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])
