"""The ``fsdptrain`` command line: parse, compose, validate, hand off.

Thin by design: typer parses, hydra's compose API builds the config from ``conf/`` and the overrides, one validation
pass checks it, and the work is handed to the ranks (``--nproc`` local processes through torch's elastic launcher, or
this process under torchrun). Importing this module does not import torch, so ``--help`` is instant.

Exit codes: 0 success, 1 a failed check or run, 2 a usage error (bad override, bad value, missing file), 3 an output
the user named (``--json``, ``--out``) could not be written.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from datetime import datetime
from pathlib import Path
from typing import List, Optional

import typer
from omegaconf import DictConfig, OmegaConf

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError, trainer_ranks, validate_world
from fsdptrain.registry.errors import OUTPUT_NOT_WRITTEN_EXIT, OutputNotWritten
from fsdptrain.preflight import (
    check_command_source,
    check_inputs,
    check_run_dir,
    check_sft_inputs,
    check_train_inputs,
    check_training_data,
    check_user_functions,
)

# Never reach the network: a model name that is not a local folder is a usage error (fsdptrain/model/checks.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

USAGE_ERROR = 2

app = typer.Typer(
    name="fsdptrain",
    help="RL post-training (PPO/GRPO) for causal LMs on PyTorch FSDP2, with packed sequences and metrics that mean "
    "the same under any packing, micro-batching and parallel layout.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    epilog="Examples:  fsdptrain train  |  fsdptrain train algorithm=grpo loss.agg_mode=token-sum trainer.steps=5  |  "
    "fsdptrain check-metrics --nproc 2  |  fsdptrain check-reward  |  fsdptrain train --cfg  |  "
    "fsdptrain plot runs/NAME.  Your own task: docs/your-task.md",
)

OVERRIDES = typer.Argument(None, help="Hydra overrides, e.g. loss.agg_mode=token-sum trainer.steps=5 algorithm=grpo")
CONFIG_DIR = typer.Option(None, "--config-dir", help="Folder of your own configs (ours stay on the search path).")
CONFIG_NAME = typer.Option("config", "--config-name", help="Primary config name in the config folder.")
PRINT_CFG = typer.Option(False, "--cfg", help="Print the resolved config as YAML and exit.")
NPROC = typer.Option(1, "--nproc", min=1, help="Local processes to launch (refused under torchrun).")


def _fail_usage(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(USAGE_ERROR)


def _default_run_name() -> str:
    """A fresh name for an unnamed run: the start time and a random suffix, so two launches in the same second
    never share a folder. Under torchrun every rank (and a restarted rank) must agree without talking: the name is
    the rendezvous id torchrun gives all of them (``TORCHELASTIC_RUN_ID``) when it set one."""
    from fsdptrain.distributed.torchrun import under_torchrun

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if under_torchrun():
        shared = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        return stamp if shared in ("", "none") else "torchrun-" + "".join(c for c in shared if c.isalnum())[:16]
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def _run_dir(cfg: DictConfig) -> Path:
    """The run directory, made absolute here, once: the user's code (a reward function, a tool, an environment) may
    change the working directory later, and no file of the run is ever found through it (docs/checkpointing.md)."""
    if cfg.trainer.run_dir is not None:
        return Path(cfg.trainer.run_dir).absolute()
    return (Path("runs") / (cfg.trainer.run_name or _default_run_name())).absolute()


UNSUPPORTED_CFG_VALUES = ("job", "hydra", "all")
"""Values hydra's ``--cfg`` takes; ours is a plain flag."""


def _refuse_hydra_flags(overrides: List[str], print_cfg: bool) -> None:
    """Hydra's own command-line flags (``-m``/``--multirun``, ``--info``, ``--cfg job``...) are not fsdptrain's: one
    line saying so, instead of an override parse error."""
    for item in overrides:
        if item.startswith("-"):
            _fail_usage(f"{item} is not supported by fsdptrain (hydra's own flags such as -m/--multirun, --info, "
                        f"--run, -c are not); the options are listed by --help, overrides are key=value")
        if print_cfg and item in UNSUPPORTED_CFG_VALUES:
            _fail_usage(f"--cfg {item} is not supported: fsdptrain's --cfg takes no value and prints the resolved "
                        f"config; drop {item!r}")


def _sft_overrides(overrides: List[str]) -> List[str]:
    """``fsdptrain sft``'s overrides: the ``data=sft`` preset first (a user's ``data=...`` replaces it). What does not
    apply to supervised fine-tuning (an algorithm, rollout or reward setting) is refused by the rules of the composed
    config, whatever route set it (`fsdptrain/config/sft_rules.py`)."""
    has_data = any(item.split("=", 1)[0] == "data" for item in overrides)
    return list(overrides) if has_data else ["data=sft", *overrides]


def _claim_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Check, lock and claim the run directory for this run (rank 0 under torchrun; the parent otherwise)."""
    from fsdptrain.run.ownership import claim_run_dir, lock_run_dir, refuse_foreign_folder

    where = f"trainer.run_dir={run_dir}" if cfg.trainer.run_dir is not None else f"trainer.run_name={run_dir.name}"
    refuse_foreign_folder(run_dir, where)  # before the lock or the probe touch the user's folder
    check_run_dir(run_dir)
    lock_run_dir(run_dir)
    claim_run_dir(cfg, run_dir, where)


def _dispatch(command: str, overrides: Optional[List[str]], config_dir: Optional[str], config_name: str,
              print_cfg: bool, nproc: int, options: Optional[List[str]] = None) -> None:
    """Compose and validate in this (parent) process, then run the ranks; ``options`` are the command's own
    arguments for the ranks (e.g. ``["--json", PATH]``), passed on their command line."""
    from fsdptrain.distributed.torchrun import env_rank, torchrun_world_size, under_torchrun

    if nproc != 1 and under_torchrun():
        _fail_usage(f"--nproc {nproc} was given under torchrun: torchrun already started the ranks; drop --nproc")
    _refuse_hydra_flags(overrides or [], print_cfg)
    try:
        if command == "sft":
            overrides = _sft_overrides(overrides or [])
        cfg = compose_config(overrides or [], config_dir=config_dir, config_name=config_name)
        check_command_source(command, cfg)
        world_size = torchrun_world_size() if under_torchrun() else nproc
        validate_world(cfg, trainer_ranks(cfg, world_size) if command == "train" else world_size)
        check_user_functions(cfg)
        if command in ("train", "check-reward"):
            check_train_inputs(cfg)
    except ConfigError as err:
        _fail_usage(str(err))
    if print_cfg:
        typer.echo(OmegaConf.to_yaml(cfg), nl=False)
        raise typer.Exit(0)
    run_dir = str(_run_dir(cfg))
    try:
        if command == "sft":
            check_sft_inputs(cfg)
        else:
            check_inputs(cfg)
        if command == "train":
            check_training_data(cfg)  # the rows and the token budget, before the run folder is claimed
        if command in ("train", "sft") and env_rank() == 0:
            _claim_run_dir(cfg, Path(run_dir))
    except ConfigError as err:
        _fail_usage(str(err))
    if under_torchrun():
        from fsdptrain.launch import die_with_parent

        die_with_parent(os.getppid())  # torchrun's agent: a rank must not outlive it
    if under_torchrun() or nproc == 1:
        # This process is the (only) rank: signals reach the trainer directly, as they do under torchrun.
        from fsdptrain import worker

        worker.run_and_exit(command, cfg, run_dir, options or [])
    from fsdptrain.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="fsdptrain-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        OmegaConf.save(cfg, config_path)
        code = launch_local(nproc, [command, str(config_path), run_dir, *(options or [])])
    raise typer.Exit(code)


def _config_command(name: str, *, short_help: str, help: str) -> None:
    """Register ``fsdptrain <name> [overrides]``: a command that composes the config and runs ``name`` on the ranks,
    with the options every such command takes (``--config-dir``, ``--config-name``, ``--cfg``, ``--nproc``)."""

    def command(
        overrides: Optional[List[str]] = OVERRIDES,
        config_dir: Optional[str] = CONFIG_DIR,
        config_name: str = CONFIG_NAME,
        print_cfg: bool = PRINT_CFG,
        nproc: int = NPROC,
    ) -> None:
        _dispatch(name, overrides, config_dir, config_name, print_cfg, nproc)

    app.command(name, context_settings={"ignore_unknown_options": True}, short_help=short_help, help=help)(command)


_config_command(
    "train",
    short_help="Train with PPO or GRPO. e.g. fsdptrain train algorithm=grpo trainer.steps=5",
    help="Train a policy (and a value model for PPO) with PPO or GRPO.\n\n"
    "Example: fsdptrain train algorithm=grpo loss.agg_mode=token-sum trainer.steps=5",
)
_config_command(
    "sft",
    short_help="Supervised fine-tuning on demonstrations. e.g. fsdptrain sft model.path=DIR data.path=chats.jsonl",
    help="Fine-tune the policy on demonstrations: chats (messages, tool calls included) or prompt + completion rows, "
    "the loss on the assistant's (the completion's) tokens only (docs/sft.md).\n\n"
    "Example: fsdptrain sft model.path=DIR data.path=chats.jsonl data.eval_path=held_out.jsonl trainer.steps=100",
)


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
    options = []
    if json_out is not None:
        from fsdptrain.preflight import check_output_file

        try:
            check_output_file(json_out, option="--json")
        except ConfigError as err:
            _fail_usage(str(err))
        options = ["--json", str(json_out.resolve())]
    _dispatch("check-metrics", overrides, config_dir, config_name, print_cfg, nproc, options)


_config_command(
    "check-reward",
    short_help="Try the reward on the current model's samples. e.g. fsdptrain check-reward data=prompts ...",
    help="Load the data and reward functions, sample rollout.n completions for a few prompts with the current model "
    "(no training) and print each function's spread, a few samples and the time per call.\n\n"
    "Exits 1 when every prompt group scored all-equal (GRPO's group baseline would learn nothing), 0 otherwise.\n\n"
    # rich reads [...] as markup: the bracket is escaped so that the example prints as typed
    "Example: fsdptrain check-reward data=prompts data.path=train.jsonl 'reward.functions=\\[exact_match]'",
)


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
    except OutputNotWritten as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(OUTPUT_NOT_WRITTEN_EXIT)
    typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
