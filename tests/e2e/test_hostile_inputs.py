"""Hostile inputs through the real CLI (issue 32): folders, names, configs, model folders and checkpoints the user
brings. Each case exits 2 with one line naming the culprit, no traceback, and leaves the user's files as they were.
The table of simpler bad inputs is tests/e2e/test_bad_inputs.py."""

from __future__ import annotations

from pathlib import Path

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
