"""The user's tools, environments and reward functions that end their process or hang, through the real CLI (issue 42
items 2, 3 and 11): one line naming the tool (or class and method), exit 2 and no checkpoint, never a traceback, a
false "interrupted" (130) or an exit 0 with nothing written; a hung tool is cut off at reward.timeout_s in the training
process too; SIGTERM stops a run whose tool hangs within the documented grace, with either engine, with and without
workers. The mechanism (every ending, in the process and in workers) is tests/unit/test_tool_calls.py; the tiny
model that calls the tool from the first step is tests/e2e/test_multi_turn.py's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdptrain.run.signals import HARD_EXIT_S, USER_CODE_GRACE_S
from tests.conftest import cli_command, run_cli
from tests.e2e.test_multi_turn import write_inputs
from tests.unit.test_tool_calls import TOOLS

TOOLS_PY = TOOLS + '''

def add(a: int, b: int) -> int:  # the tiny model calls add: this one ends the way TOOL_HOW says, or adds
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    ends(os.environ["TOOL_HOW"])
    return a + b


class Env:
    def reset(self, **columns):
        return 42  # not a string


def os_exit0(prompts, completions, completion_ids, **kwargs):
    os._exit(0)
'''


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = write_inputs(tmp_path_factory.mktemp("hostile_tools"))
    (folder / "hostile.py").write_text(TOOLS_PY)
    return folder


def args(folder: Path, *extra: str) -> list[str]:
    return ["train", "model=local", f"model.path={folder / 'model'}", "algorithm=grpo", "data=prompts",
            f"data.path={folder / 'prompts.jsonl'}", "data.num_eval_prompts=0", "rollout.max_new_tokens=96",
            "rollout.max_turns=2", "rollout.prompts_per_step=2", "rollout.n=4", "trainer.eval_every=0",
            "logging.progress=false", "trainer.steps=1", f"rollout.tools=[{folder}/hostile.py:add]",
            f"reward.functions=[{folder}/rewards.py:said_five]", *extra]


def last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.strip()][-1]


@pytest.mark.parametrize(("how", "workers", "engine", "said"), [
    ("exit0", 0, "generate", "raised SystemExit(0)"),
    ("os_exit0", 0, "continuous", "called os._exit(0)"),
    ("interrupt", 1, "generate", "raised KeyboardInterrupt (a BaseException)"),
    ("halt", 1, "continuous", "raised Halt: no more (a BaseException)"),
])
def test_a_tool_that_ends_its_process_stops_the_run_with_one_line_naming_it(inputs, tmp_path, how, workers, engine,
                                                                             said):
    result = run_cli(*args(inputs, f"reward.num_workers={workers}", f"rollout.engine={engine}"), cwd=tmp_path,
                     env={"TOOL_HOW": how})
    assert result.returncode == 2, result.stderr[-3000:]
    assert last_line(result.stderr) == f"error: tool 'add': {said} (a tool returns its result; it must not exit)"
    run = next((tmp_path / "runs").iterdir())
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(("extra", "culprit"), [
    (("rollout.tools=[]", "rollout.environment={folder}/hostile.py:Env"),
     r"error: environment method 'Env\.reset' on row \d+ \(0-based\): returned int 42, not a string or None"),
    (("reward.functions=[{folder}/hostile.py:os_exit0]",),
     r"error: reward function 'os_exit0' on row \d+ \(0-based\): called os\._exit\(0\) \(a reward function returns "
     r"its values; it must not exit\) \(the call covered 8 samples\)"),
])
def test_an_environment_or_reward_that_misbehaves_is_one_line_never_exit_0(inputs, tmp_path, extra, culprit):
    result = run_cli(*args(inputs, *[e.format(folder=inputs) for e in extra]), cwd=tmp_path, env={"TOOL_HOW": "add"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.fullmatch(culprit, last_line(result.stderr)), result.stderr[-3000:]
    run = next((tmp_path / "runs").iterdir())
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_a_hung_tool_in_the_training_process_is_cut_off_at_the_timeout(inputs, tmp_path):
    result = run_cli(*args(inputs, "reward.num_workers=0", "reward.timeout_s=0.5", "rollout.engine=continuous"),
                     cwd=tmp_path, env={"TOOL_HOW": "hang", "TOOL_READY": str(tmp_path / "ready")}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(next((tmp_path / "runs").iterdir()).joinpath("metrics.jsonl").read_text().splitlines()[0])
    assert row["tools/num_timed_out"] > 0 and row["tools/failure_frequency"] == 1.0


def stop_while_the_tool_hangs(folder: Path, cwd: Path, *extra: str) -> tuple[int, str, float]:
    ready = cwd / "ready"
    err = open(cwd / "stderr", "w+")
    proc = subprocess.Popen([*cli_command(), *args(folder, *extra)], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "TOOL_HOW": "hang", "TOOL_READY": str(ready)})
    try:
        deadline = time.monotonic() + 300  # safety net: `ready` appears once the tool's call runs
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), err.seek(0) or err.read()[-3000:]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)  # safety net
        took = time.monotonic() - start
    finally:
        proc.kill()
    err.seek(0)
    return proc.returncode, err.read(), took


@pytest.mark.parametrize(("engine", "workers"), [
    ("generate", 0),
    ("continuous", 1),
    pytest.param("generate", 1, marks=pytest.mark.slow),  # CI time: the two above cover both engines and both places
    pytest.param("continuous", 0, marks=pytest.mark.slow),
])
def test_sigterm_stops_a_run_whose_tool_hangs_within_the_grace(inputs, tmp_path, engine, workers):
    code, stderr, took = stop_while_the_tool_hangs(inputs, tmp_path, f"rollout.engine={engine}",
                                                   f"reward.num_workers={workers}")
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    what = "tool 'add'" if workers == 0 else "a call of the tools 'add'"
    assert last_line(stderr) == (f"error: SIGTERM: {what} did not return within {USER_CODE_GRACE_S:g} s of the "
                                 "signal; stopped without saving this step (the last checkpoint stays)")
    assert took < USER_CODE_GRACE_S + HARD_EXIT_S + 15, took  # 15 s: leaving (the workers, the process) on a busy CI
    assert not (next((tmp_path / "runs").iterdir()) / "checkpoints").exists()
