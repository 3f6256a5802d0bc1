"""User code that changes the process's state (issue 42, class 4): a tool and a reward function that move the
working directory, point HOME and TMPDIR elsewhere and change the umask. The run's own paths (run directory,
checkpoints, metrics, samples, export, the lock) are absolute and fixed when the CLI starts, so the run writes where
it was told, and resumes there (docs/checkpointing.md)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli
from tests.e2e.test_multi_turn import common, write_inputs

MOVES = '''
import os, tempfile

ELSEWHERE = tempfile.mkdtemp(prefix="fsdptrain-elsewhere-")


def wander():
    """Leave the launch folder and change what a relative path or a temp file would mean."""
    os.chdir(ELSEWHERE)
    os.environ["HOME"] = ELSEWHERE
    os.environ["TMPDIR"] = ELSEWHERE
    tempfile.tempdir = None
    os.umask(0o077)
'''

TOOLS_PY = MOVES + '''

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    wander()
    return a + b
'''

REWARD_PY = MOVES + '''

def moves_and_scores(prompts, completions, completion_ids, answer, **kwargs):
    """1 when a tool message holds the answer; moves the process first."""
    wander()
    with open("reward_was_here.txt", "w") as handle:  # relative: lands in ELSEWHERE, not in the run
        handle.write("x")
    return [float(any(m["role"] == "tool" and m["content"] == answer for m in c)) for c in completions]
'''


def test_a_tool_and_a_reward_that_change_the_cwd_do_not_move_the_run(tmp_path):
    inputs = write_inputs(tmp_path / "inputs")
    (inputs / "tools.py").write_text(TOOLS_PY)
    (inputs / "rewards.py").write_text(REWARD_PY)
    launch = tmp_path / "launch"
    launch.mkdir()
    args = (*common(inputs), "rollout.max_new_tokens=16", "rollout.max_turns=2", "rollout.n=2",
            f"rollout.tools=[{inputs}/tools.py:add]", f"reward.functions=[{inputs}/rewards.py:moves_and_scores]",
            "logging.samples_every=1",
            "checkpoint.every=1", "trainer.run_name=wander")
    first = run_cli("train", *args, "trainer.steps=2", cwd=launch)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = launch / "runs" / "wander"
    assert sorted(p.name for p in launch.iterdir()) == ["runs"]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert (run_dir / "export" / "policy" / "model.safetensors").is_file()
    assert '"role": "tool"' in (run_dir / "samples.jsonl").read_text()  # the tool ran (and moved the process)

    again = run_cli("train", *args, "trainer.steps=3", "trainer.resume=auto", cwd=launch)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_00000002 after step 2" in again.stdout, again.stdout[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in launch.iterdir()) == ["runs"]
    assert not list(Path(inputs).glob("reward_was_here.txt"))
