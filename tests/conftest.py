"""Shared test helpers: run the real CLI as a subprocess."""

from __future__ import annotations

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


@pytest.fixture
def cli(tmp_path):
    """Run the CLI in a fresh working directory (runs/ lands there)."""

    def _run(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return run_cli(*args, cwd=tmp_path, env=env, timeout=timeout)

    return _run
