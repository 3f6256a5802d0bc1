"""Experiment trackers: ``logging.backends`` beyond metrics.jsonl (always written), each through its own library.

- ``tensorboard``: event files under ``<run_dir>/tensorboard`` (``torch.utils.tensorboard``; needs ``tensorboard``).
- ``wandb``: a run named after the run directory, files under ``<run_dir>``; ``WANDB_MODE=offline`` (or
  ``wandb offline``) keeps it local.
- ``mlflow``: a run in the experiment ``fsdptrain`` of the tracking URI mlflow is configured with
  (``MLFLOW_TRACKING_URI``; when unset, a local store ``file:<run_dir>/mlruns``).

Only rank 0 opens trackers. A backend whose library is missing is refused by the CLI before any rank starts
(:func:`missing_backend_message`), so a run never trains for an hour and then finds it cannot log.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

BACKEND_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Backend -> the module it needs (the pip extra of the same name installs it: ``pip install fsdptrain[wandb]``)."""


def missing_backend_message(backends: Sequence[str]) -> Optional[str]:
    """One line naming the first backend whose library is not installed, or None (torch-free: the CLI calls it)."""
    for backend in backends:
        module = BACKEND_MODULES.get(backend)
        if module is not None and importlib.util.find_spec(module) is None:
            return (f"logging.backends: {backend} needs the {module} package: pip install fsdptrain[{backend}] "
                    f"(or drop {backend} from logging.backends)")
    return None


def _numbers(result: dict) -> dict[str, float]:
    return {k: float(v) for k, v in result.items() if k != "step" and isinstance(v, (int, float))}


class Trackers:
    """The configured trackers of one run (none on ranks other than 0); :meth:`log` each step, :meth:`close` once."""

    def __init__(self, cfg: DictConfig, run_dir: Path, *, is_main: bool):
        self.tensorboard = self.wandb = self.mlflow = None
        if not is_main:
            return
        backends = set(cfg.logging.backends)
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if "wandb" in backends:
            import wandb

            self.wandb = wandb.init(project="fsdptrain", name=run_dir.name, dir=str(run_dir),
                                    config=OmegaConf.to_container(cfg, resolve=True))
        if "mlflow" in backends:
            import mlflow

            uri = os.environ.setdefault("MLFLOW_TRACKING_URI", f"file:{run_dir.resolve() / 'mlruns'}")
            if uri.startswith("file:") or "://" not in uri:
                # a local folder is what an offline run has; mlflow 3 wants an opt-in for its file store
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_experiment("fsdptrain")
            self.mlflow = mlflow
            mlflow.start_run(run_name=run_dir.name)
            mlflow.log_params({"algorithm": cfg.algorithm.name, "data.source": cfg.data.source,
                               "run_dir": str(run_dir)})

    def log(self, result: dict) -> None:
        values, step = _numbers(result), int(result["step"])
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            # mlflow's metric names may not hold some characters; ours are letters, digits, / _ . -
            self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
        self.tensorboard = self.wandb = self.mlflow = None
