"""Hostile inputs, fourth round (issue 56), through the real CLI: a path that is not a regular file (a named pipe)
named by any command and any data source, and an output the command cannot write. Each subprocess runs under a
timeout, so an input that holds the CLI fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_hostile_inputs import one_error_line

HANG = 120
"""Seconds a case may take: the CLI's imports on a loaded 2-core machine, far below a hang."""


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _model_folder_with_a_pipe(root: Path) -> Path:
    """A real tiny model folder whose tokenizer_config.json is a named pipe (the tokenizer's loader would open it)."""
    from tests.helpers.teacher_folders import save_teacher

    folder = save_teacher(root / "model")
    (folder / "tokenizer_config.json").unlink()
    fifo(folder / "tokenizer_config.json")
    return folder


def _chats(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"{a}+1?"}, {"role": "assistant", "content": str(a + 1)}]}
            for a in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run_with_metrics_pipe(root: Path) -> Path:
    (root / "run").mkdir()
    fifo(root / "run" / "metrics.jsonl")
    return root / "run"


def _run_with_metrics(root: Path) -> Path:
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return root / "run"


def _config_dir_with_a_pipe(root: Path) -> Path:
    (root / "conf").mkdir()
    fifo(root / "conf" / "mine.yaml")
    return root / "conf"


PROMPTS = ("data=prompts", "reward.functions=[exact_match]")
CASES = {  # case: (the arguments, made in tmp_path; what the one line must name)
    "train data=prompts data.path": (lambda t: ["train", *PROMPTS, f"data.path={fifo(t / 'p.jsonl')}"], "data.path"),
    "train data=prompts data.eval_path": (lambda t: ["train", *PROMPTS, f"data.path={_chats(t / 'p.jsonl')}",
                                                     f"data.eval_path={fifo(t / 'e.jsonl')}"], "data.eval_path"),
    "train data=jsonl data.path": (lambda t: ["train", "data=jsonl", "rollout.max_new_tokens=4",
                                              f"data.path={fifo(t / 'r.jsonl')}"], "data.path"),
    "train model.path": (lambda t: ["train", f"model.path={_model_folder_with_a_pipe(t)}"], "tokenizer_config.json"),
    "train algorithm.distill.teacher": (lambda t: ["train", "algorithm=grpo",
                                                   f"algorithm.distill.teacher={_model_folder_with_a_pipe(t)}"],
                                        "algorithm.distill.teacher"),
    "train reward function file": (lambda t: ["train", f"reward.functions=[{fifo(t / 'r.py')}:score]"],
                                   "reward.functions"),
    "train tool file": (lambda t: ["train", f"rollout.tools=[{fifo(t / 'tools.py')}:add]"], "rollout.tools"),
    "train --config-dir": (lambda t: ["train", "--config-dir", str(_config_dir_with_a_pipe(t)), "--config-name",
                                      "mine"], "mine.yaml"),
    "sft data.path": (lambda t: ["sft", f"data.path={fifo(t / 'c.jsonl')}"], "data.path"),
    "sft data.eval_path": (lambda t: ["sft", f"data.path={_chats(t / 'c.jsonl')}",
                                      f"data.eval_path={fifo(t / 'e.jsonl')}"], "data.eval_path"),
    "check-reward data.path": (lambda t: ["check-reward", *PROMPTS, f"data.path={fifo(t / 'p.jsonl')}"],
                               "data.path"),
    "check-metrics --json": (lambda t: ["check-metrics", "--json", str(fifo(t / 'out.json'))], "--json"),
    "plot RUN_DIR/metrics.jsonl": (lambda t: ["plot", str(_run_with_metrics_pipe(t))], "metrics.jsonl"),
    "plot --out": (lambda t: ["plot", str(_run_with_metrics(t)), "--out", str(fifo(t / 'out.png'))], "--out"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_named_pipe_anywhere_a_path_is_named_is_one_line_at_once(tmp_path, case):
    make, culprit = CASES[case]
    line = one_error_line(run_cli(*make(tmp_path), cwd=tmp_path, timeout=HANG))
    assert "named pipe" in line and culprit in line, line
    assert not (tmp_path / "runs").exists()


def test_check_metrics_json_on_a_full_disk_names_the_option_not_a_run_folder(tmp_path):
    """/dev/full takes the open and fails every write with ENOSPC: the checks run and pass, the report cannot be
    written, and the line says so (not a training run's disk-full stop with a resume, not a failed comparison's 1)."""
    result = run_cli("check-metrics", "--json", "/dev/full", cwd=tmp_path, timeout=600)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: --json /dev/full could not be written (No space left on device)"), lines[0]
    assert "resume" not in lines[0] and "runs/" not in lines[0]
    assert not (tmp_path / "runs").exists()


def test_plot_out_on_a_full_disk_names_the_option(tmp_path):
    pytest.importorskip("matplotlib")
    result = run_cli("plot", str(_run_with_metrics(tmp_path)), "--out", "/dev/full", cwd=tmp_path, timeout=HANG)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 3 and "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: --out /dev/full could not be written (No space left on device)"), lines[0]


def test_a_setting_sft_refuses_is_refused_from_the_users_config_file(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(
        f"defaults:\n  - config\n  - override algorithm: grpo\n  - _self_\ndata:\n  path: {_chats(tmp_path / 'c.jsonl')}\n"
        "trainer:\n  steps: 1\n")
    line = one_error_line(run_cli("sft", "--config-dir", "conf", "--config-name", "mine", cwd=tmp_path, timeout=HANG))
    assert "algorithm.name='grpo' does not apply to fsdptrain sft" in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("text", "culprit"), [
    ("algorithm:\n  plugins: " + "[" * 3000 + "]" * 3000 + "\n", "values nest deeper than 32 levels"),
    ("trainer: &t\n  x: *t\n", "a node that contains itself"),
    ("trainer:\n  steps: !!int abc\n", "the config library cannot build it (ValueError"),
])
def test_a_config_the_library_cannot_build_is_one_line_not_a_traceback(tmp_path, text, culprit):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n" + text)
    line = one_error_line(run_cli("train", "--config-dir", "conf", "--config-name", "mine", cwd=tmp_path,
                                  timeout=HANG))
    assert "mine.yaml" in line and culprit in line, line
