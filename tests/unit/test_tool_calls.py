"""Tools and environment methods go through the one place that runs user code (fsdptrain/rewards/pool.py
``call_user_code``), in this process and in tool workers: an Exception is the model's error message; an attempt to end
the process (sys.exit with any status, os._exit, any other BaseException, a worker that dies) is one ToolError naming
the tool or the class and method; ``reward.timeout_s`` cuts a call off in the training process too; a tool worker
imports the tools' files before its first call, outside any call's deadline (issue 42 items 2, 3, 5)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from fsdptrain.rollout.tools import (ToolCall, ToolCaller, ToolError, load_environment, load_tools, start_episode,
                                     tool_pool)

TOOLS = '''
import os, signal, sys, time

time.sleep(float(os.environ.get("TOOL_IMPORT_SLEEP", "0")))  # a slow import (a model, a large table)


class Halt(BaseException):
    pass


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b


def fails(x: int) -> int:
    """Fails.

    Args:
        x: anything
    """
    raise ValueError(f"bad x {x}")


def ends(how: str) -> str:
    """Tries to end the process.

    Args:
        how: which way
    """
    if how == "exit0":
        sys.exit(0)
    if how == "exit3":
        sys.exit(3)
    if how == "os_exit0":
        os._exit(0)
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "halt":
        raise Halt("no more")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        open(os.environ["TOOL_READY"], "w").close()
        time.sleep(600)
    return "still here"


def sleeps(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


class Counter:
    def reset(self, **columns):
        if columns.get("reset") == "raises":
            raise RuntimeError("no episode")
        if columns.get("reset") == "exits":
            sys.exit(0)
        if columns.get("reset") == "hangs":
            time.sleep(60)
        return 7 if columns.get("reset") == "int" else " go"

    def step(self, how: str) -> str:
        """Steps.

        Args:
            how: which way
        """
        return ends(how)
'''

ENDINGS = [
    ("exit0", "raised SystemExit(0)"),
    ("exit3", "raised SystemExit(3)"),
    ("os_exit0", "called os._exit(0)"),
    ("interrupt", "raised KeyboardInterrupt (a BaseException)"),
    ("halt", "raised Halt: no more (a BaseException)"),
]


@pytest.fixture
def tools(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    # The trainer's own SIGINT handler is installed in training; with Python's default one a KeyboardInterrupt in the
    # main thread could be a real Ctrl-C, and passes (fsdptrain/rewards/pool.py _is_stop).
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    yield load_tools([f"tools.py:{name}" for name in ("add", "fails", "ends", "sleeps")])
    signal.signal(signal.SIGINT, previous)


def run_one(caller: ToolCaller, name: str, **arguments):
    return caller.run([ToolCall(0, name, arguments)])[0]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_exception_is_the_models_error_and_an_ending_stops_the_run_naming_the_tool(tools, num_workers):
    caller = ToolCaller(tools, pool=tool_pool(tools, num_workers), timeout_s=None)
    try:
        assert run_one(caller, "add", a=2, b=3).content == "5"
        failed = run_one(caller, "fails", x=4)
        assert failed.failed and json.loads(failed.content) == {"error": "ValueError: bad x 4"}
        for how, said in ENDINGS:
            with pytest.raises(ToolError) as err:
                run_one(caller, "ends", how=how)
            assert str(err.value) == f"tool 'ends': {said} (a tool returns its result; it must not exit)"
            assert run_one(caller, "ends", how="no").content == "still here"  # this process (or worker) lives on
        if num_workers:
            with pytest.raises(ToolError, match=r"^tool 'ends': the tool worker process died \(exit code -9\)$"):
                run_one(caller, "ends", how="kill")
    finally:
        if caller.pool is not None:
            caller.pool.close()


def test_environment_methods_go_through_the_same_place_naming_class_and_method(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    environment = load_environment("tools.py:Counter")
    env, observation = start_episode(environment, {}, row=3, timeout_s=None)
    assert observation == " go"
    caller = ToolCaller([], pool=None, timeout_s=None)
    assert caller.run([ToolCall(0, "step", {"how": "no"})], [env])[0].content == "still here"
    with pytest.raises(ToolError, match=r"^environment method 'Counter.step': called os._exit\(0\) \(a tool returns"):
        caller.run([ToolCall(0, "step", {"how": "os_exit0"})], [env])
    for columns, message in [
        ({"reset": "int"}, "environment method 'Counter.reset' on row 3 (0-based): returned int 7, not a string or "
                           "None"),
        ({"reset": "raises"}, "environment method 'Counter.reset' on row 3 (0-based): raised RuntimeError: no episode"),
        ({"reset": "exits"}, "environment method 'Counter.reset' on row 3 (0-based): raised SystemExit(0) (it must "
                             "return)"),
        ({"reset": "hangs"}, "environment method 'Counter.reset' on row 3 (0-based): did not return within "
                             "reward.timeout_s=0.5 s"),
    ]:
        with pytest.raises(ToolError) as err:
            start_episode(environment, columns, row=3, timeout_s=0.5)
        assert str(err.value) == message


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_hung_call_is_cut_off_at_the_timeout_in_the_process_and_in_workers(tools, num_workers):
    caller = ToolCaller(tools, pool=tool_pool(tools, num_workers), timeout_s=1.0)
    try:
        start = time.monotonic()
        result = run_one(caller, "sleeps", seconds=60)
        assert time.monotonic() - start < 30
        assert result.timed_out and result.failed and json.loads(result.content) == {"error": "timed out after 1s"}
        assert run_one(caller, "sleeps", seconds=0).content == "woke"
    finally:
        if caller.pool is not None:
            caller.pool.close()


def test_a_slow_tool_import_does_not_count_against_the_calls_deadline(tools, monkeypatch):
    # The workers import tools.py (3 s) when they start, before the first call; a 2 s call deadline is then met.
    monkeypatch.setenv("TOOL_IMPORT_SLEEP", "3")
    pool = tool_pool(tools, 1)
    try:
        result = ToolCaller(tools, pool=pool, timeout_s=2.0).run([ToolCall(0, "add", {"a": 1, "b": 1})])[0]
        assert not result.timed_out and result.content == "2"
    finally:
        pool.close()


class Scored:
    def __init__(self, value):
        self.value = value

    def get_reward(self):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


@pytest.mark.parametrize(("value", "cause"), [
    ("high", "returned str 'high', not a number or None"),
    (float("inf"), "returned inf, not a finite number"),
    (ValueError("no score"), "raised ValueError: no score (the call covered 2 samples)"),
    (SystemExit(0), "raised SystemExit(0) (a reward function returns its values; it must not exit) (the call covered "
                    "2 samples)"),
])
def test_get_reward_has_a_reward_functions_rules_and_its_errors_name_the_method(value, cause):
    import numpy as np

    from fsdptrain.rewards.loading import RewardFunction
    from fsdptrain.rewards.runner import RewardBatch, RewardError, RewardRunner
    from fsdptrain.rollout.tools import ENVIRONMENT_REWARD_SPEC, environment_reward

    function = RewardFunction(name="Scored", spec=ENVIRONMENT_REWARD_SPEC, fn=environment_reward, weight=1.0,
                              method="get_reward")

    def batch(values):
        return RewardBatch(prompts=["p", "p"], completions=["a", "b"], completion_ids=[[1], [2]], rows=[5, 5],
                           groups=[0, 0], columns={"environments": [Scored(v) for v in values]})

    with RewardRunner([function]) as runner:
        assert runner.score(batch([np.float32(0.5), 2])).raw == {"Scored": [0.5, 2.0]}
        with pytest.raises(RewardError) as err:
            runner.score(batch([1.0, value]))
    assert str(err.value) == f"reward function 'Scored.get_reward' on row 5 (0-based): {cause}"
