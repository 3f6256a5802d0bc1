"""How every dist worker starts and leaves: ``@dist_worker`` parses ``--out`` (and the worker's own options), runs
torch on one thread, joins the process group, runs the worker's body, writes this rank's JSON for the test
(``<out>/rank<r>.json``, what tests/dist/launch.py collects), tears the group down and exits with the code.

    @dist_worker(option("--modes", default="token-mean"), traceback_in_record=True)
    def main(args, info, record):
        record["results"] = ...

    if __name__ == "__main__":
        main()
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from fsdptrain.distributed import world

Option = tuple[tuple[str, ...], dict[str, Any]]
Body = Callable[[argparse.Namespace, world.DistInfo, dict], None]


def option(*flags: str, **kwargs: Any) -> Option:
    """One argument of a worker's command line, as ``argparse.ArgumentParser.add_argument(*flags, **kwargs)``."""
    return flags, kwargs


def dist_worker(*options: Option, traceback_in_record: bool = False) -> Callable[[Body], Callable[[], None]]:
    """Make ``body(args, info, record)`` a worker's ``main()``: the one way a dist worker starts and leaves.

    ``args`` holds ``--out`` (a Path) and ``options``; a worker with a ``--device`` option joins the group on that
    device (else the CPU one). The body fills ``record``, which becomes this rank's JSON and exit code 0. When it
    raises: with ``traceback_in_record`` the record (``{"error": None, ...}`` until then) gets the traceback under
    ``"error"`` and is written as usual, exit code 1 (the test shows it from the JSON); without, the traceback goes to
    the output and the process exits with code 1 writing nothing and leaving the group as it is (the test shows the
    output).
    """

    def wrap(body: Body) -> Callable[[], None]:
        def main() -> None:
            parser = argparse.ArgumentParser()
            parser.add_argument("--out", type=Path, required=True)
            for flags, kwargs in options:
                parser.add_argument(*flags, **kwargs)
            args = parser.parse_args()
            torch.set_num_threads(1)
            info = world.init_distributed(device_type=getattr(args, "device", "cpu"))
            record: dict = {"error": None} if traceback_in_record else {}
            code = 0
            try:
                body(args, info, record)
            except Exception:
                if not traceback_in_record:
                    traceback.print_exc()
                    world.exit_process(1)
                record["error"] = traceback.format_exc()
                code = 1
            report_and_exit(args.out, info.rank, record, code)

        main.__doc__ = body.__doc__
        return main

    return wrap


def report_and_exit(out_dir: str | Path, rank: int, record: dict, code: int) -> None:
    """``out_dir/rank<rank>.json`` holds ``record``; then the process group is destroyed and the process exits."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    world.destroy_distributed()
    world.exit_process(code)
