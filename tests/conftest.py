"""Shared test helpers: run the real CLI as a subprocess; tell a run's compared metrics by their recorded kinds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def cli_command() -> list[str]:
    """The installed console script when present, else the module (same code either way)."""
    script = Path(sys.executable).parent / "fsdptrain"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "fsdptrain.cli"]


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run([*cli_command(), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def metric_kinds(run_dir: Path) -> dict[str, str]:
    """What a run wrote to ``metric_kinds.json``: name -> kind of every number its metrics.jsonl holds."""
    return json.loads((Path(run_dir) / "metric_kinds.json").read_text())


def without_diagnostics(row: dict, kinds: dict[str, str]) -> dict:
    """A metrics.jsonl line without its DIAGNOSTIC numbers (timings, fill), told by the recorded kind and never by
    the name (docs/metrics.md); every number of the line must have a kind."""
    missing = sorted(set(row) - set(kinds) - {"step"})
    assert not missing, f"metric_kinds.json has no kind for {missing}"
    return {name: value for name, value in row.items() if kinds.get(name) != "diagnostic"}


@pytest.fixture
def cli(tmp_path):
    """Run the CLI in a fresh working directory (runs/ lands there)."""

    def _run(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return run_cli(*args, cwd=tmp_path, env=env, timeout=timeout)

    return _run
