"""Hostile inputs through the real CLI (issue 32): folders, names, configs, model folders and checkpoints the user
brings. Each case exits 2 with one line naming the culprit, no traceback, and leaves the user's files as they were.
The table of simpler bad inputs is tests/e2e/test_bad_inputs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

TINY = ("rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
        "logging.progress=false")


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def test_a_folder_of_the_users_own_files_is_never_a_run_folder(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    files = {"config.yaml": b"model: mine\nlr: 3\n", "samples.jsonl": b'{"q": "2+2", "a": 4}\n', "notes.txt": b"x\n"}
    for name, data in files.items():
        (proj / name).write_bytes(data)
    result = run_cli("train", *TINY, "trainer.steps=1", "trainer.run_dir=proj", "trainer.overwrite=true",
                     cwd=tmp_path)
    line = one_error_line(result)
    assert "proj holds files fsdptrain did not write (config.yaml, notes.txt, samples.jsonl)" in line, line
    assert {p.name: p.read_bytes() for p in proj.iterdir()} == files  # nothing lost, nothing added (not even a lock)


@pytest.mark.parametrize(("args", "culprit"), [
    (("trainer.run_name=../../outside",), "trainer.run_name='../../outside' must be a plain name"),
    (("--config-dir", "d", "--config-name", "mine"), "d/mine.yaml:2: not valid YAML"),
    (("-m", "trainer.steps=1,2"), "-m is not supported by fsdptrain"),
    (("--multirun",), "--multirun is not supported by fsdptrain"),
    (("--info",), "--info is not supported by fsdptrain"),
    (("--cfg", "job"), "--cfg job is not supported"),
])
def test_names_configs_and_hydra_flags_are_one_line(tmp_path, args, culprit):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.yaml").write_text("trainer:\n\tsteps: 1\n")
    line = one_error_line(run_cli("train", *args, cwd=tmp_path))
    assert culprit in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and not (tmp_path.parent / "outside").exists()
