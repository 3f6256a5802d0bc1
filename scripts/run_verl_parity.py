"""Run verl's own CPU tests of its PPO core against fsdptrain, through the translation layer tests/verl_parity/shim.

    python scripts/run_verl_parity.py /path/to/verl            # a verl checkout: its tests/trainer/ppo/test_*.py
    python scripts/run_verl_parity.py /path/to/dir_or_file ... # any test files or folders
    VERL_TESTS=/path/to/verl python scripts/run_verl_parity.py -- -k rollout   # after --: pytest's own options

The shim (a package named `verl`) is put first on the path, so verl's test files run unchanged and every number they
check comes from fsdptrain. pytest runs with `--import-mode=importlib`, so the checkout's own `verl` package is never
imported. A manual parity check (docs/verl-names.md, "verl's own tests"): CI has no verl checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "tests" / "verl_parity" / "shim"


def test_targets(paths: list[str]) -> list[str]:
    """Each path as given, except a verl checkout (it holds tests/trainer/ppo), which gives that folder's test files."""
    out = []
    for path in map(Path, paths):
        ppo = path / "tests" / "trainer" / "ppo"
        out += sorted(str(p) for p in ppo.glob("test_*.py")) if ppo.is_dir() else [str(path)]
    return out


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    paths, pytest_args = argv[:cut], argv[cut + 1:]
    if not paths and os.environ.get("VERL_TESTS"):
        paths = [os.environ["VERL_TESTS"]]
    if not paths:
        print("usage: run_verl_parity.py VERL_CHECKOUT_OR_TEST_PATH ... [-- PYTEST_ARGS] (or set VERL_TESTS)",
              file=sys.stderr)
        return 2
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"run_verl_parity.py: no such path: {missing[0]}", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider",
           "--rootdir", str(SHIM), "-c", os.devnull, *test_targets(paths), *pytest_args]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
