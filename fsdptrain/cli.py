"""The ``fsdptrain`` command line: parse, compose, validate, hand off.

Thin by design: typer parses, hydra's compose API builds the config from ``conf/`` and the overrides, one validation
pass checks it, and the work is handed to the ranks (``--nproc`` local processes through torch's elastic launcher, or
this process under torchrun). Importing this module does not import torch, so ``--help`` is instant.

Exit codes: 0 success, 1 a failed check or run, 2 a usage error (bad override, bad value, missing file).
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import List, Optional

import typer
from omegaconf import DictConfig, OmegaConf

from fsdptrain.compose import compose_config
from fsdptrain.config import ConfigError, validate_world

# Never reach the network: a model name that is not a local folder is a usage error (fsdptrain/model/checks.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

USAGE_ERROR = 2
CHECK_JSON_ENV = "FSDPTRAIN_CHECK_JSON"
"""Where check-metrics' ranks write ``--json``: set by the command, read by the ranks (fsdptrain.worker)."""

app = typer.Typer(
    name="fsdptrain",
    help="RL post-training (PPO/GRPO) for causal LMs on PyTorch FSDP2, with packed sequences and metrics that mean "
    "the same under any packing, micro-batching and parallel layout.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    epilog="Examples:  fsdptrain train  |  fsdptrain train algorithm=grpo loss.agg_mode=token-sum trainer.steps=5  |  "
    "fsdptrain check-metrics --nproc 2  |  fsdptrain train --cfg  |  fsdptrain plot runs/NAME",
)

OVERRIDES = typer.Argument(None, help="Hydra overrides, e.g. loss.agg_mode=token-sum trainer.steps=5 algorithm=grpo")
CONFIG_DIR = typer.Option(None, "--config-dir", help="Folder of your own configs (ours stay on the search path).")
CONFIG_NAME = typer.Option("config", "--config-name", help="Primary config name in the config folder.")
PRINT_CFG = typer.Option(False, "--cfg", help="Print the resolved config as YAML and exit.")
NPROC = typer.Option(1, "--nproc", min=1, help="Local processes to launch (refused under torchrun).")


def _fail_usage(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(USAGE_ERROR)


def _run_dir(cfg: DictConfig) -> Path:
    if cfg.trainer.run_dir is not None:
        return Path(cfg.trainer.run_dir)
    name = cfg.trainer.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / name


def _claim_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Check, lock and claim the run directory for this run (rank 0 under torchrun; the parent otherwise)."""
    from fsdptrain.preflight import check_run_dir
    from fsdptrain.train.run_ownership import claim_run_dir, lock_run_dir

    check_run_dir(run_dir)
    lock_run_dir(run_dir)
    where = f"trainer.run_dir={run_dir}" if cfg.trainer.run_dir is not None else f"trainer.run_name={run_dir.name}"
    claim_run_dir(cfg, run_dir, where)


def _dispatch(command: str, overrides: Optional[List[str]], config_dir: Optional[str], config_name: str,
              print_cfg: bool, nproc: int) -> None:
    from fsdptrain.distributed.torchrun import torchrun_world_size, under_torchrun

    if nproc != 1 and under_torchrun():
        _fail_usage(f"--nproc {nproc} was given under torchrun: torchrun already started the ranks; drop --nproc")
    try:
        cfg = compose_config(overrides or [], config_dir=config_dir, config_name=config_name)
        world_size = torchrun_world_size() if under_torchrun() else nproc
        validate_world(cfg, world_size)
    except ConfigError as err:
        _fail_usage(str(err))
    if print_cfg:
        typer.echo(OmegaConf.to_yaml(cfg), nl=False)
        raise typer.Exit(0)
    run_dir = str(_run_dir(cfg))
    try:
        from fsdptrain.preflight import check_inputs

        check_inputs(cfg)
        if command == "train" and int(os.environ.get("RANK", "0")) == 0:
            _claim_run_dir(cfg, Path(run_dir))
    except ConfigError as err:
        _fail_usage(str(err))
    if under_torchrun():
        from fsdptrain.launch import die_with_parent

        die_with_parent(os.getppid())  # torchrun's agent: a rank must not outlive it
    if under_torchrun() or nproc == 1:
        # This process is the (only) rank: signals reach the trainer directly, as they do under torchrun.
        from fsdptrain import worker

        worker.run_and_exit(command, cfg, run_dir)
    from fsdptrain.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="fsdptrain-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        OmegaConf.save(cfg, config_path)
        code = launch_local(nproc, [command, str(config_path), run_dir])
    raise typer.Exit(code)


@app.command(
    context_settings={"ignore_unknown_options": True},
    short_help="Train with PPO or GRPO. e.g. fsdptrain train algorithm=grpo trainer.steps=5",
)
def train(
    overrides: Optional[List[str]] = OVERRIDES,
    config_dir: Optional[str] = CONFIG_DIR,
    config_name: str = CONFIG_NAME,
    print_cfg: bool = PRINT_CFG,
    nproc: int = NPROC,
) -> None:
    """Train a policy (and a value model for PPO) with PPO or GRPO.

    Example: fsdptrain train algorithm=grpo loss.agg_mode=token-sum trainer.steps=5
    """
    _dispatch("train", overrides, config_dir, config_name, print_cfg, nproc)


@app.command(
    "check-metrics",
    context_settings={"ignore_unknown_options": True},
    short_help="Prove metrics are layout-invariant. e.g. fsdptrain check-metrics loss.agg_mode=token-sum --nproc 2",
)
def check_metrics(
    overrides: Optional[List[str]] = OVERRIDES,
    config_dir: Optional[str] = CONFIG_DIR,
    config_name: str = CONFIG_NAME,
    print_cfg: bool = PRINT_CFG,
    nproc: int = NPROC,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every result (per layout and metric) here."),
) -> None:
    """Prove that loss, gradients and metrics are the same packed or unpacked, under any micro-batching and dp size.

    Example: fsdptrain check-metrics loss.agg_mode=seq-mean-token-sum --nproc 2 --json check.json
    """
    # The ranks read the path from the environment (inherited by every launched rank); a stale value never leaks in.
    os.environ.pop(CHECK_JSON_ENV, None)
    if json_out is not None:
        from fsdptrain.preflight import check_output_file

        try:
            check_output_file(json_out, option="--json")
        except ConfigError as err:
            _fail_usage(str(err))
        os.environ[CHECK_JSON_ENV] = str(json_out.resolve())
    _dispatch("check-metrics", overrides, config_dir, config_name, print_cfg, nproc)


@app.command(short_help="Plot a run's metrics to a PNG. e.g. fsdptrain plot runs/my-run")
def plot(
    run_dir: Path = typer.Argument(..., help="Run directory holding metrics.jsonl."),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG path (default RUN_DIR/metrics.png)."),
) -> None:
    """Draw reward, eval reward, losses, grad norms, KL, entropy and response length to a PNG."""
    from fsdptrain.plot import plot_run

    try:
        path = plot_run(run_dir, out)
    except ValueError as err:  # a missing run, metrics file or matplotlib: the user's to fix
        _fail_usage(str(err))
    typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
