"""One rank's entry point: load the parent's resolved config, run the command, leave through one exit path.

``python -m fsdptrain.worker COMMAND CONFIG_YAML RUN_DIR`` is what the local launcher starts on every rank; under
torchrun the CLI calls :func:`run_rank` in-process. Every rank leaves through :func:`exit_process`, which flushes and
calls ``os._exit`` with the real exit code: processes that used gloo and ``fully_shard`` can abort in interpreter
teardown otherwise (platform notes), turning a success into a crash.
"""

from __future__ import annotations

import os
import sys
import traceback

from omegaconf import DictConfig, OmegaConf

NOT_BUILT = "the {command} loop is not built yet: the config is valid, nothing was trained"


def exit_process(code: int) -> None:
    """Flush stdout/stderr and leave with ``code`` at once, skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(command: str, cfg: DictConfig, run_dir: str) -> int:
    """Run ``command`` ("train" or "check-metrics") on this rank; return its exit code."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"fsdptrain {command}: " + NOT_BUILT.format(command=command), file=sys.stderr)
    return 1


def main(argv: list[str]) -> None:
    command, config_path, run_dir = argv
    cfg = OmegaConf.load(config_path)
    assert isinstance(cfg, DictConfig)
    try:
        code = run_rank(command, cfg, run_dir)
    except BaseException:  # an internal error: keep its traceback, then leave through the one exit path
        traceback.print_exc()
        code = 1
    exit_process(code)


if __name__ == "__main__":
    # Run through the importable module, not this __main__ copy, so there is one fsdptrain.worker in the process.
    from fsdptrain.worker import main as _main

    _main(sys.argv[1:])
