"""Every test tier is collected by the README's test command: pytest's default `norecursedirs` lists "dist", which
once left all of tests/dist (the multi-process gloo tests) out of CI without a word."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_the_readme_command_collects_every_test_file():
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}
    on_disk = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").rglob("test_*.py")}
    assert on_disk - collected == set()
    assert any(name.startswith("tests/dist/") for name in collected)
