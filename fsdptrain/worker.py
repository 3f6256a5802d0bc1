"""One rank's entry point: load the parent's resolved config, run the command, leave through one exit path.

``python -m fsdptrain.worker COMMAND CONFIG_YAML RUN_DIR [--json PATH]`` is what the local launcher starts on every
rank; under
torchrun, or with a single process, the CLI calls :func:`run_and_exit` in-process. Every rank leaves through
``exit_process``, which flushes and calls ``os._exit`` with the real exit code: processes that used gloo and
``fully_shard`` can abort in interpreter teardown otherwise, turning a success into a crash (docs/architecture.md).
"""

from __future__ import annotations

import errno
import os
import sys
import traceback

from omegaconf import DictConfig, OmegaConf

from fsdptrain.distributed.rank_errors import ERROR_DIR_ENV, PEER_LOST_EXIT, peer_lost, report_failure
from fsdptrain.distributed.torchrun import env_rank
from fsdptrain.distributed.world import exit_process

COMMANDS = ("train", "sft", "check-metrics", "check-reward")


def run_rank(command: str, cfg: DictConfig, run_dir: str, options: list[str]) -> int:
    """Run ``command`` ("train" or "check-metrics") on this rank; return its exit code.

    A user's mistake found only here (a bad data row, a model folder that does not load) is a usage error: its one
    line is reported (:func:`fsdptrain.distributed.rank_errors.report_failure`; by rank 0 only without our launcher)
    and every rank returns 2. A reward function that fails at run time stops every rank (the ranks agree on it); the
    rank where it failed reports the user's traceback and one line, and every rank returns 2. A tool or environment
    method that fails so (it tried to end the process) reports the same way and returns 2; the other ranks stop when
    they find it gone.
    """
    from fsdptrain.config import ConfigError
    from fsdptrain.distributed.placement import GeneratorFailed
    from fsdptrain.rewards.runner import RewardFailedOnAnotherRank, UserCodeError

    rank = env_rank()
    assert command in COMMANDS, command
    try:
        from fsdptrain.registry.plugins import import_plugins

        import_plugins(list(cfg.algorithm.plugins))  # their registered names, before anything resolves one
        if command == "train":
            from fsdptrain.train.rl import train

            return train(cfg, run_dir)
        if command == "sft":
            from fsdptrain.train.sft import sft

            return sft(cfg, run_dir)
        if command == "check-reward":
            from fsdptrain.train.check_reward import check_reward

            return check_reward(cfg)
        from fsdptrain.check.run import check_metrics

        return check_metrics(cfg, json_path=_option(options, "--json"))
    except ConfigError as err:
        if rank == 0 or ERROR_DIR_ENV in os.environ:  # the launcher reports the first rank's, once
            report_failure(f"error: {err}", rank=rank)
        return 2
    except UserCodeError as err:  # a reward function, a tool, an environment method
        report_failure((err.user_traceback.rstrip("\n") + "\n" if err.user_traceback else "") + f"error: {err}",
                       rank=rank)
        return 2
    except RewardFailedOnAnotherRank:  # the rank where it failed prints the error
        return 2
    except GeneratorFailed as err:  # rollout.placement=separate: a generator rank died, hung or raised
        report_failure(f"error: {err}", rank=rank)
        return 1
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)) or not _disk_full(err):
            raise
        if rank == 0:
            report_failure(_disk_full_message(command, run_dir, err), rank=rank)
        return 1


def _disk_full_message(command: str, run_dir: str, err: BaseException) -> str:
    """The one line of a full disk: a run folder and a resume only for the commands that have one (train, sft); the
    others name what failed (an output the user named has its own message and exit code: OutputNotWritten)."""
    if command in ("train", "sft"):
        return (f"error: no space left on the device while writing {run_dir}; the run stopped and earlier checkpoints "
                "are intact: free some space and resume with trainer.resume=auto")
    from fsdptrain.registry.errors import first_line

    return f"error: no space left on the device during fsdptrain {command} ({first_line(err)}): free some space"


def _disk_full(err: BaseException | None, depth: int = 0) -> bool:
    """True when ``err`` or anything it wraps (a cause, a DCP per-rank failure) is ENOSPC."""
    if err is None or depth > 8:
        return False
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    failures = getattr(err, "failures", None)
    nested = list(failures.values()) if isinstance(failures, dict) else []
    nested = [item[0] if isinstance(item, tuple) and item else item for item in nested]  # DCP: (exception, traceback)
    return any(_disk_full(e, depth + 1) for e in [err.__cause__, err.__context__, *nested]
               if isinstance(e, BaseException))


def _option(options: list[str], name: str) -> str | None:
    """The value after ``name`` in a command's options, or None."""
    return options[options.index(name) + 1] if name in options else None


def run_and_exit(command: str, cfg: DictConfig, run_dir: str, options: list[str]) -> None:
    """Run this rank and leave through the one exit path, whatever happens (internal errors keep their traceback)."""
    from fsdptrain.run.signals import StoppedInUserCode

    try:
        code = run_rank(command, cfg, run_dir, options)
    except StoppedInUserCode as err:
        report_failure(f"error: {err}", rank=env_rank())
        code = err.exit_code
    except KeyboardInterrupt:
        print("interrupted: stopped at once, nothing saved", file=sys.stderr)
        code = 130
    except BaseException as err:  # an internal error: keep its traceback, then leave through the one exit path
        if peer_lost(err):  # collateral of another rank's failure, which that rank reports (rank_errors.py)
            code = PEER_LOST_EXIT
        else:
            traceback.print_exc()
            code = 1
    exit_process(code)


def main(argv: list[str]) -> None:
    from fsdptrain.launch import LAUNCHER_PID_ENV, die_with_parent

    if LAUNCHER_PID_ENV in os.environ:
        die_with_parent(int(os.environ[LAUNCHER_PID_ENV]))
    command, config_path, run_dir, *options = argv
    cfg = OmegaConf.load(config_path)
    assert isinstance(cfg, DictConfig)
    run_and_exit(command, cfg, run_dir, options)


if __name__ == "__main__":
    # Run through the importable module, not this __main__ copy, so there is one fsdptrain.worker in the process.
    from fsdptrain.worker import main as _main

    _main(sys.argv[1:])
