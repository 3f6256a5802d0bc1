"""The one way a dist worker leaves: write this rank's JSON for the test, tear the group down, exit with the code."""

from __future__ import annotations

import json
from pathlib import Path

from fsdptrain.distributed import world


def report_and_exit(out_dir: str | Path, rank: int, record: dict, code: int) -> None:
    """``out_dir/rank<rank>.json`` holds ``record``; then the process group is destroyed and the process exits."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    world.destroy_distributed()
    world.exit_process(code)
