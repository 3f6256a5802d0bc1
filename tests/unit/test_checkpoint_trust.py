"""Which checkpoint files resume trusts (issue 32 item 6): DCP's `.metadata` is read with an unpickler that builds only
DCP's metadata classes, and every file of a checkpoint is checked against the size and sha256 its marker recorded.
Real checkpoints of a real model and optimizer, written by `save_checkpoint` in one process."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from fsdptrain.distributed.sharded_checkpoint import (
    checkpoint_problem,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
)


def _save(run_dir: Path, step: int) -> Path:
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return save_checkpoint(run_dir, step, models={"policy": model}, optimizers={"policy": optimizer},
                           schedulers={}, extra={"step": step}, run_id="r")


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[Path, Path]:
    return _save(tmp_path, 1), _save(tmp_path, 2)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo ran > {self.marker}",)


def test_a_planted_metadata_pickle_is_a_damaged_checkpoint_and_never_runs(two_checkpoints, tmp_path, capsys):
    older, newest = two_checkpoints
    marker = tmp_path / "code-ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    assert newest_intact_checkpoint(tmp_path, "r") == older
    warning = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"warning: skipping damaged checkpoint {re.escape(str(newest))}: \.metadata is truncated "
                        r"\(\d+ of \d+ bytes\); falling back to an older one", warning), warning
    assert not marker.exists()


@pytest.mark.parametrize("with_digests", [True, False])
def test_the_metadata_reader_builds_only_checkpoint_classes(two_checkpoints, tmp_path, with_digests):
    older, newest = two_checkpoints
    from fsdptrain.distributed.sharded_checkpoint import read_dcp_metadata

    assert type(read_dcp_metadata(older)).__name__ == "Metadata"
    marker = tmp_path / "code-ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    if not with_digests:  # a checkpoint written before the marker recorded digests: the unpickler alone guards
        info = __import__("json").loads((newest / "complete.json").read_text())
        del info["files"]
        (newest / "complete.json").write_text(__import__("json").dumps(info))
    problem = checkpoint_problem(newest)
    assert problem is not None and (with_digests or "it names posix.system" in problem), problem
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="not checkpoint metadata .*it names posix.system"):
        load_checkpoint(newest, models={"policy": model}, optimizers={}, schedulers={})
    assert not marker.exists()


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "damage", "message"), [
    ("__0_0.distcp", _flip_a_byte, "__0_0.distcp changed since it was saved (sha256 differs)"),
    ("rng_rank0.pt", lambda f: f.write_bytes(f.read_bytes()[:10]), "rng_rank0.pt is truncated (10 of"),
    ("trainer_state.pt", lambda f: f.write_bytes(f.read_bytes() + b"x"), "trainer_state.pt has"),
    (".metadata", lambda f: f.unlink(), ".metadata is missing"),
])
def test_any_damaged_file_of_the_newest_checkpoint_falls_back(two_checkpoints, tmp_path, capsys, name, damage,
                                                                message):
    older, newest = two_checkpoints
    assert checkpoint_problem(newest) is None
    damage(newest / name)
    assert message in checkpoint_problem(newest)
    assert newest_intact_checkpoint(tmp_path, "r") == older
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
