"""Run a worker script under torch's elastic launcher (real processes, gloo) and collect its JSON results.

Each launch costs about 5 s of start-up, so one worker runs many checks and every rank writes its findings to
`<out_dir>/rank<r>.json`; the tests assert on those numbers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


@dataclass
class LaunchResult:
    returncode: int
    output: str
    results: dict[int, dict]  # rank -> that rank's JSON

    def describe(self) -> str:
        return f"exit code {self.returncode}; output:\n{self.output[-6000:]}"

    def checked(self, nproc: int, *, error_free: bool = False) -> LaunchResult:
        """Assert the launch exited 0 and ranks 0..nproc-1 each wrote their JSON; with ``error_free``, also that each
        record's ``"error"`` (a worker's ``@dist_worker(traceback_in_record=True)``) is None. Returns this result."""
        assert self.returncode == 0, self.describe()
        assert sorted(self.results) == list(range(nproc)), self.describe()
        if error_free:
            for rank in range(nproc):
                assert self.results[rank]["error"] is None, self.results[rank]["error"]
        return self


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # CI has 2 cores shared by every rank
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], out_dir: Path, timeout_s: float) -> LaunchResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    # A session of its own, so that a timeout kills the launcher and every rank it started, not the launcher only.
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its ranks (they run in sessions of their own); SIGKILL what is left.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        returncode, output = -1, f"TIMEOUT after {timeout_s} s\n{output}"
    results = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}
    return LaunchResult(returncode=returncode, output=output, results=results)


def launch(worker: str, *, nproc: int, out_dir: Path, args: tuple[str, ...] = (), timeout_s: float = 300.0):
    """`python -m torch.distributed.run --standalone --nproc_per_node nproc workers/<worker> --out out_dir *args`."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(WORKERS / worker), "--out", str(out_dir), *args,
    ]
    return _run(cmd, out_dir, timeout_s)


def run_single(worker: str, *, out_dir: Path, args: tuple[str, ...] = (), timeout_s: float = 300.0):
    """The worker as a plain process, no launcher and no torchrun environment (a world of one)."""
    return _run([sys.executable, str(WORKERS / worker), "--out", str(out_dir), *args], out_dir, timeout_s)
