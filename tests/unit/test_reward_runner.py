"""Reward functions: loading by name, the weighted total with None, every run-time failure as one RewardError, and
worker processes that time out, get replaced and leave nothing behind."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdptrain.config import ConfigError
from fsdptrain.rewards.loading import RewardFunction, load_reward_functions, require_module
from fsdptrain.rewards.runner import RewardBatch, RewardError, RewardRunner

USER_FILE = '''
import time

def length(prompts, completions, completion_ids, **kwargs):
    return [float(len(c)) for c in completions]

def only_even(prompts, completions, completion_ids, parity, **kwargs):
    return [1.0 if p == "even" else None for p in parity]

def boom(prompts, completions, completion_ids, **kwargs):
    return helper(completions)

def helper(completions):
    raise ValueError("no luck with " + completions[0])

def short(prompts, completions, completion_ids, **kwargs):
    return [1.0]

def scalar(prompts, completions, completion_ids, **kwargs):
    return 1.0

def text(prompts, completions, completion_ids, **kwargs):
    return ["high"] * len(completions)

def nan(prompts, completions, completion_ids, **kwargs):
    return [float("nan")] * len(completions)

def flags(prompts, completions, completion_ids, **kwargs):
    return [c == "bb" for c in completions]

def slow_on_b(prompts, completions, completion_ids, **kwargs):
    if completions[0].startswith("b"):
        time.sleep(60)
    return [2.0] * len(completions)

def pid(prompts, completions, completion_ids, **kwargs):
    import os
    return [float(os.getpid())] * len(completions)

def exits(prompts, completions, completion_ids, **kwargs):
    import os
    os._exit(3)

def exits_0(prompts, completions, completion_ids, **kwargs):
    import os
    os._exit(0)

def leaves_0(prompts, completions, completion_ids, **kwargs):
    import sys
    sys.exit()

def interrupts(prompts, completions, completion_ids, **kwargs):
    raise KeyboardInterrupt

class Halt(BaseException):
    pass

def halts(prompts, completions, completion_ids, **kwargs):
    raise Halt("stop everything")

def sleeps(prompts, completions, completion_ids, **kwargs):
    time.sleep(60)
    return [2.0] * len(completions)

def killed(prompts, completions, completion_ids, **kwargs):
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)

def leaves(prompts, completions, completion_ids, **kwargs):
    import sys
    sys.exit(3)

def huge(prompts, completions, completion_ids, **kwargs):
    return [10**400] * len(completions)

def hang_when_told(prompts, completions, completion_ids, **kwargs):
    # readiness for the tests: once the call runs (and its children exist), write their pids, then hang
    import os, subprocess, multiprocessing
    ready = os.environ.get("REWARD_READY_FILE")
    if ready is None or not completions[0].startswith("b"):
        return [2.0] * len(completions)
    children = [subprocess.Popen(["sleep", "600"]).pid]
    if os.environ.get("REWARD_FORK_POOL"):
        pool = multiprocessing.get_context("fork").Pool(2)
        children += [p.pid for p in pool._pool]
    if os.environ.get("REWARD_FORK_CHILD"):  # a forked child that says when it runs its own code
        child = multiprocessing.get_context("fork").Process(target=_forked_child, args=(ready + ".child",))
        child.start()
        while not os.path.exists(ready + ".child"):
            time.sleep(0.01)
        children.append(child.pid)
    with open(ready + ".tmp", "w") as f:
        f.write(" ".join(map(str, [os.getpid(), *children])))
    os.replace(ready + ".tmp", ready)
    time.sleep(600)

def _forked_child(ready):
    open(ready, "w").close()
    time.sleep(600)
'''


@pytest.fixture
def user(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FILE)
    return lambda name: f"{path}:{name}"


def batch():
    # two prompt groups (rows 10 and 11), two samples each
    return RewardBatch(prompts=["p0", "p0", "p1", "p1"], completions=["a", "aaa", "bb", "b"],
                       completion_ids=[[1], [1, 1, 1], [2, 2], [2]], rows=[10, 10, 11, 11], groups=[0, 0, 1, 1],
                       columns={"parity": ["even", "even", "odd", "odd"]})


def test_weighted_total_leaves_none_out_and_counts_samples_without_reward(user):
    functions = load_reward_functions([user("length"), user("only_even")], [0.5, 2.0], columns=["parity"])
    with RewardRunner(functions) as runner:
        scores = runner.score(batch())
    assert scores.raw == {"length": [1.0, 3.0, 2.0, 1.0], "only_even": [1.0, 1.0, None, None]}
    assert scores.total == [0.5 * 1 + 2.0, 0.5 * 3 + 2.0, 0.5 * 2, 0.5 * 1]
    assert scores.num_no_reward == 0 and scores.num_timed_out == {"length": 0, "only_even": 0}
    with RewardRunner(load_reward_functions([user("only_even")])) as runner:
        scores = runner.score(batch())
    assert scores.total == [1.0, 1.0, 0.0, 0.0] and scores.num_no_reward == 2


def test_bools_count_as_one_and_zero(user):
    with RewardRunner(load_reward_functions([user("flags")])) as runner:
        assert runner.score(batch()).total == [0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("name, message", [
    ("boom", "reward function 'boom' on row 10 (0-based): raised ValueError: no luck with a (the call covered 4 "
             "samples)"),
    ("short", "reward function 'short' on row 10 (0-based): returned 1 values for 4 samples"),
    ("scalar", "reward function 'scalar' on row 10 (0-based): returned a float, not a list with one value per sample "
                "(the call covered 4 samples)"),
    ("text", "reward function 'text' on row 10 (0-based): returned str 'high', not a number or None"),
    ("nan", "reward function 'nan' on row 10 (0-based): returned nan, not a finite number"),
    ("leaves", "reward function 'leaves' on row 10 (0-based): raised SystemExit(3) (a reward function returns its "
               "values; it must not exit) (the call covered 4 samples)"),
    ("huge", "reward function 'huge' on row 10 (0-based): returned int of 1329 bits, too large for a float"),
])
def test_each_runtime_failure_is_one_reward_error(user, name, message):
    with RewardRunner(load_reward_functions([user(name)])) as runner:
        with pytest.raises(RewardError) as err:
            runner.score(batch())
    assert str(err.value) == message


def test_the_error_carries_the_users_traceback_not_ours(user):
    with RewardRunner(load_reward_functions([user("boom")])) as runner:
        with pytest.raises(RewardError) as err:
            runner.score(batch())
    tb = err.value.user_traceback
    assert "in boom" in tb and "in helper" in tb and "ValueError: no luck with a" in tb
    assert "runner.py" not in tb and "pool.py" not in tb


def test_errors_name_the_samples_row_in_workers_too(user):
    with RewardRunner(load_reward_functions([user("boom")]), num_workers=1) as runner:
        with pytest.raises(RewardError) as err:
            runner.score(batch())
    assert str(err.value) == ("reward function 'boom' on row 10 (0-based): raised ValueError: no luck with a "
                              "(the call covered 2 samples)")
    assert "in helper" in err.value.user_traceback and "pool.py" not in err.value.user_traceback
    with RewardRunner(load_reward_functions([user("leaves")]), num_workers=1) as runner:
        pids = runner.pool.pids
        with pytest.raises(RewardError, match=r"^reward function 'leaves' on row 10 \(0-based\): raised SystemExit\(3\) "):
            runner.score(batch())
        assert runner.pool.pids == pids  # the worker took sys.exit as the function's error, and lives on


def test_a_reward_file_is_imported_as_python_runs_it_and_a_failing_import_is_one_line(tmp_path):
    task = tmp_path / "task"
    task.mkdir()
    (task / "helpers.py").write_text("def score(c):\n    return float(len(c))\n")
    (task / "rw.py").write_text("import helpers\n\ndef f(prompts, completions, completion_ids, **kwargs):\n"
                                "    return [helpers.score(c) for c in completions]\n")
    path_before = list(sys.path)
    functions = load_reward_functions([f"{task}/rw.py:f"])  # `python task/rw.py` finds helpers.py: so do we
    assert sys.path == path_before  # the folder was on sys.path only while importing
    with RewardRunner(functions) as here, RewardRunner(functions, num_workers=1) as pooled:
        assert here.score(batch()).total == pooled.score(batch()).total == [1.0, 3.0, 2.0, 1.0]
    for body, culprit in [("import no_such_module\n", "line 1: ModuleNotFoundError: No module named 'no_such_module'"),
                          ("X = 1\nCONST = 1/0\n", "line 2: ZeroDivisionError: division by zero"),
                          ("import sys\n\nsys.exit(3)\n", "line 3: it called sys.exit(3)")]:
        (task / "bad.py").write_text(body)
        with pytest.raises(ConfigError) as err:
            load_reward_functions([f"{task}/bad.py:f"])
        assert str(err.value) == (f"reward.functions: importing '{task}/bad.py' failed at {culprit} "
                                  f"(from '{task}/bad.py:f')")
        assert sys.path == path_before


def test_workers_import_before_their_first_call_within_their_own_bound(tmp_path):
    slow = tmp_path / "slow_import.py"
    slow.write_text("import time\ntime.sleep(float(open(__file__ + '.s').read()))\n\n"
                    "def f(prompts, completions, completion_ids, **kwargs):\n    return [1.0] * len(completions)\n")
    (tmp_path / "slow_import.py.s").write_text("3")
    # Built by hand: the parent never imports the file here, only the workers do.
    functions = [RewardFunction(name="f", spec=f"{slow}:f", fn=None, weight=1.0)]
    # An import of 3 s, longer than the 1.5 s a call may take, does not count against any call's deadline.
    with RewardRunner(functions, num_workers=2, timeout_s=1.5) as runner:
        scores = runner.score(batch())
    assert scores.num_timed_out == {"f": 0} and scores.total == [1.0] * 4
    # An import that never ends is reported at the start-up bound, and the worker does not stay behind.
    (tmp_path / "slow_import.py.s").write_text("600")
    before = set(_children())  # multiprocessing's resource tracker may be one
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        RewardRunner(functions, num_workers=1, timeout_s=1.5, start_timeout_s=1.0)
    assert time.monotonic() - start < 60  # safety net only: the bound is 1 s
    assert str(err.value) == (f"reward function 'f': a reward worker took longer than 1 s to import '{slow}:f' "
                              f"(imports are bounded apart from reward.timeout_s)")
    assert not [p for p in set(_children()) - before if _alive(p)]


def test_a_timed_out_worker_is_killed_with_every_process_it_started(user, tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    monkeypatch.setenv("REWARD_READY_FILE", str(ready))
    monkeypatch.setenv("REWARD_FORK_POOL", "1")  # a fork-based multiprocessing.Pool inside the reward function
    # 5 s: a generous bound for the call to start its children and write `ready`; the call itself hangs 600 s
    with RewardRunner(load_reward_functions([user("hang_when_told")]), num_workers=1, timeout_s=5.0) as runner:
        scores = runner.score(batch())
        assert scores.num_timed_out == {"hang_when_told": 2}
        pids = [int(p) for p in ready.read_text().split()]  # the worker, `sleep 600` and the pool's processes
        assert len(pids) == 4
        _wait_until_gone(pids[1:])  # SIGKILL to the group is sent; the worker's children are not ours to reap
        assert not [p for p in pids if _alive(p)]


def _wait_until_gone(pids: list[int], safety_net_s: float = 30.0) -> None:
    deadline = time.monotonic() + safety_net_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


STOP_SCRIPT = """
import os, sys
if __name__ == "__main__":  # imports here: a spawned worker re-runs this file's top level
    from fsdptrain.rewards.loading import load_reward_functions
    from fsdptrain.rewards.runner import RewardBatch, RewardRunner
    from fsdptrain.run.signals import StopRequest, StoppedInUserCode, user_code

    StopRequest(grace_s=1.0).install()
    runner = RewardRunner(load_reward_functions([sys.argv[1]]), num_workers=int(sys.argv[2]))
    try:
        with user_code("reward function 'hang_when_told'"):
            runner.score(RewardBatch(["p"], ["b"], [[1]], [0], [0]))
    except StoppedInUserCode as err:
        runner.close()
        print(f"error: {err}", file=sys.stderr, flush=True)
        os._exit(err.exit_code)
    os._exit(0)
"""


@pytest.mark.parametrize("num_workers", [0, 1])
def test_sigterm_during_a_hung_reward_call_stops_after_the_grace(user, tmp_path, num_workers):
    script, ready = tmp_path / "trainer.py", tmp_path / "ready"
    script.write_text(STOP_SCRIPT)
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "REWARD_READY_FILE": str(ready),
           "REWARD_FORK_CHILD": "1"}
    err = open(tmp_path / "stderr", "w+")  # a file, not a pipe: the user's `sleep 600` may hold a pipe open
    proc = subprocess.Popen([sys.executable, str(script), user("hang_when_told"), str(num_workers)], env=env,
                            stdout=subprocess.DEVNULL, stderr=err, text=True)
    children = []
    try:
        deadline = time.monotonic() + 120  # safety net: the call writes `ready` once it (and its child) runs
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        caller, *children = [int(p) for p in ready.read_text().split()]
        forked = children[-1]
        if num_workers == 0:  # forked by the trainer's process: SIGTERM ends it (no handler of ours inherited)
            os.kill(forked, signal.SIGTERM)
            _wait_until_gone([forked])
            assert not _alive(forked)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)  # safety net: the grace is 1 s
    finally:
        proc.kill()
        for pid in children if num_workers == 0 else []:  # in-process, the user's children are the user's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    err.seek(0)
    stderr = err.read()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1] == (
        "error: SIGTERM: reward function 'hang_when_told' did not return within 1 s of the signal; stopped without "
        "saving this step (the last checkpoint stays)")
    if num_workers:  # the worker went with everything it started
        _wait_until_gone([caller, *children])
        assert not [p for p in [caller, *children] if _alive(p)]


def _children() -> list[int]:
    """This process's child processes (from /proc)."""
    found = []
    for path in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        found += [int(p) for p in path.read_text().split()]
    return found


def test_workers_give_the_in_process_scores(user):
    functions = load_reward_functions([user("length"), user("only_even"), "word_match"], [0.5, 2.0, 1.0],
                                      columns=["parity", "answer"])
    b = batch()
    b = RewardBatch(b.prompts, b.completions, b.completion_ids, b.rows, b.groups,
                    {**b.columns, "answer": ["a", "a a a", "b", "b b"]})
    with RewardRunner(functions) as here, RewardRunner(functions, num_workers=2) as pooled:
        assert pooled.score(b) == here.score(b)


def test_a_call_past_the_timeout_scores_timeout_score_and_its_worker_is_replaced(user):
    functions = load_reward_functions([user("slow_on_b"), user("pid")])
    # 5 s: a fast call must never time out, even on a loaded 2-core machine; the slow one sleeps 60 s
    with RewardRunner(functions, num_workers=1, timeout_s=5.0, timeout_score=-1.0) as runner:
        before = runner.pool.pids
        start = time.monotonic()
        scores = runner.score(batch())
        assert time.monotonic() - start < 40
        after = runner.pool.pids
    assert scores.raw["slow_on_b"] == [2.0, 2.0, -1.0, -1.0]  # group 1's call timed out
    assert scores.num_timed_out == {"slow_on_b": 2, "pid": 0}
    assert before != after and not _alive(before[0])  # killed, not abandoned
    assert scores.raw["pid"][0] == float(after[0])  # the replacement ran the next calls


def test_a_worker_that_dies_is_an_error_and_the_pool_closes(user):
    runner = RewardRunner(load_reward_functions([user("killed")]), num_workers=1)
    pids = runner.pool.pids
    with pytest.raises(RewardError, match=r"'killed' on row 10 \(0-based\): the reward worker process died "
                                          r"\(exit code -9\) \(the call covered 2 samples\)"):
        runner.score(batch())
    runner.close()
    assert not any(_alive(p) for p in pids + runner.pool.pids)


def test_close_and_interrupts_leave_no_worker_behind(user, tmp_path, monkeypatch):
    runner = RewardRunner(load_reward_functions([user("length")]), num_workers=3)
    pids = runner.pool.pids
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    runner.close()
    runner.close()  # idempotent
    assert not any(_alive(p) for p in pids) and runner.pool.pids == []

    monkeypatch.setenv("REWARD_READY_FILE", str(tmp_path / "ready"))
    runner = RewardRunner(load_reward_functions([user("hang_when_told")]), num_workers=2)
    pids = runner.pool.pids
    # A real Ctrl-C once the call hangs (its `ready` file exists, no timer racing a loaded machine), sent to the main
    # thread: a process-directed os.kill may be taken by another thread, and then the main thread sleeps in poll().
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def ctrl_c_when_ready() -> None:
        deadline = time.monotonic() + 120  # safety net only
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    ctrl_c = threading.Thread(target=ctrl_c_when_ready)
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.score(batch())
    finally:
        ctrl_c.join()
        signal.signal(signal.SIGINT, previous)
    assert not any(_alive(p) for p in pids) and runner.pool.pids == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("specs, weights, columns, fragment", [
    ([], None, None, "reward.functions is empty"),
    (["exact_match"], [1.0, 2.0], None, "reward.weights has 2 entries for 1 reward.functions"),
    (["exact_match"], [float("inf")], None, "reward.weights: inf is not a finite number"),
    (["no_such_builtin"], None, None, "is not of the form module:function"),
    (["{dir}/missing.py:f"], None, None, "file '{dir}/missing.py' not found"),
    (["{user}:nope"], None, None, "has no attribute 'nope'"),
    (["{user}:helper"], None, None, "must accept (prompts, completions, completion_ids, **kwargs)"),
    (["{user}:only_even"], None, ["answer"], "needs a column 'parity' that the dataset does not have (columns: "
                                            "['answer'])"),
    (["exact_match"], None, ["parity"], "'exact_match' needs a column 'answer'"),
    (["{user}:length", "{dir}/other/user_rewards.py:length"], None, None, "two functions are named 'length'"),
])
def test_each_bad_configuration_is_one_config_error(tmp_path, user, specs, weights, columns, fragment):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "user_rewards.py").write_text(USER_FILE)
    user_file = user("x").rpartition(":")[0]
    specs = [s.format(dir=tmp_path, user=user_file) for s in specs]
    with pytest.raises(ConfigError) as err:
        load_reward_functions(specs, weights, columns=columns)
    assert fragment.format(dir=tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_a_missing_optional_package_names_the_extra():
    require_module("math_verify", extra="fsdptrain[math]", what="x")  # installed here
    with pytest.raises(ConfigError, match=r"^reward.functions: 'math' needs the no_such_pkg_xyz package: "
                                          r"pip install fsdptrain\[math\]$"):
        require_module("no_such_pkg_xyz", extra="fsdptrain[math]", what="reward.functions: 'math'")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_workers=-1), "reward.num_workers=-1 must be >= 0"),
    (dict(timeout_s=0), "reward.timeout_s=0 must be > 0"),
    (dict(num_workers=1, timeout_score=float("nan")), "reward.timeout_score=nan must be a finite number"),
])
def test_runner_settings_are_checked(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        RewardRunner(load_reward_functions(["think_format"]), **kwargs)


def test_the_worked_example_of_the_docs(tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def correct(prompts, completions, completion_ids, answer, kind, **kwargs):\n"
        "    return [None if k != 'math' else float(c.strip() == str(a)) for c, a, k in zip(completions, answer, kind)]\n"
        "\n"
        "def brevity(prompts, completions, completion_ids, **kwargs):\n"
        "    return [1.0 if len(ids) <= 8 else 0.0 for ids in completion_ids]\n")
    from fsdptrain.rewards.reward_metrics import reward_metrics
    from fsdptrain.metrics.typed import finalize

    functions = load_reward_functions([f"{tmp_path}/rewards.py:correct", f"{tmp_path}/rewards.py:brevity"],
                                      [1.0, 0.2], columns=["answer", "kind"])
    b = RewardBatch(prompts=["q"] * 2 + ["c"] * 2, completions=["7", "eight", "red", "blue is a primary colour of light"],
                    completion_ids=[[1], [1], [1], [1] * 9], rows=[0, 0, 1, 1], groups=[0, 0, 1, 1],
                    columns={"answer": [7, 7, None, None], "kind": ["math", "math", "open", "open"]})
    with RewardRunner(functions) as runner:
        scores = runner.score(b)
    assert scores.total == [1.2, 0.2, 0.2, 0.0]
    got = finalize(reward_metrics(scores, groups=b.groups))
    assert (got["reward/correct/mean"], got["reward/brevity/mean"]) == (0.5, 0.75)
    assert abs(got["reward/mean"] - 0.4) < 1e-12


def test_workers_exit_when_the_training_process_leaves_through_os_exit(user, tmp_path):
    # The trainer leaves through os._exit (no atexit handler runs); a hung worker must not outlive it.
    script = tmp_path / "parent.py"
    script.write_text(  # spawn re-imports the main module: it needs the __main__ guard, as fsdptrain.worker has
        "import os, threading, time\n"
        "from fsdptrain.rewards.loading import load_reward_functions\n"
        "from fsdptrain.rewards.runner import RewardBatch, RewardRunner\n"
        "if __name__ == '__main__':\n"
        f"    runner = RewardRunner(load_reward_functions([{user('slow_on_b')!r}]), num_workers=2)\n"
        "    print(*runner.pool.pids, flush=True)\n"
        "    batch = RewardBatch(['p'], ['b'], [[1]], [0], [0])\n"
        "    threading.Thread(target=runner.score, args=(batch,), daemon=True).start()\n"
        "    time.sleep(4)  # the call is running in a worker now\n"
        "    os._exit(0)\n")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and done.stderr == "", done.stderr
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


ENDINGS = [
    ("exits", "called os._exit(3)"),
    ("exits_0", "called os._exit(0)"),
    ("leaves_0", "raised SystemExit(None)"),
    ("interrupts", "raised KeyboardInterrupt (a BaseException)"),
    ("halts", "raised Halt: stop everything (a BaseException)"),
]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_function_that_would_end_its_process_is_one_reward_error_in_the_process_and_in_workers(user, num_workers):
    # Any status, 0 included (issue 42 item 11): os._exit raises in the calling thread instead of ending the process,
    # and a KeyboardInterrupt the function raises itself is its failure, never a false Ctrl-C: in a worker (which
    # ignores SIGINT) and in a process whose SIGINT handler is not Python's default (the trainer installs its own).
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        for name, how in ENDINGS:
            with RewardRunner(load_reward_functions([user(name)]), num_workers=num_workers) as runner:
                pids = runner.pool.pids if runner.pool else []
                with pytest.raises(RewardError) as err:
                    runner.score(batch())
                assert runner.pool is None or runner.pool.pids == pids  # the worker lives on
            covered = 4 if num_workers == 0 else 2
            assert str(err.value) == (f"reward function {name!r} on row 10 (0-based): {how} (a reward function "
                                      f"returns its values; it must not exit) (the call covered {covered} samples)")
            assert err.value.user_traceback == ""  # the line says all
    finally:
        signal.signal(signal.SIGINT, previous)


def test_os_exit_outside_a_call_still_exits(user, tmp_path):
    # The guard acts only in the thread running the user's call: a process the function forks, and our own exits,
    # still leave through the real os._exit.
    script = tmp_path / "after.py"
    script.write_text(
        "import os\n"
        "from fsdptrain.rewards.pool import call_user_code\n"
        "def forks():\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(5)\n"
        "    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "outcome = call_user_code(forks, {})\n"
        "assert outcome.values == 5, outcome\n"
        "assert call_user_code(os._exit, {'status': 4}).message == 'called os._exit(4)'\n"
        "os._exit(7)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr


def test_a_call_in_the_process_past_the_timeout_scores_timeout_score(user):
    functions = load_reward_functions([user("sleeps"), user("length")])
    with RewardRunner(functions, num_workers=0, timeout_s=1.0, timeout_score=-1.0) as runner:
        start = time.monotonic()
        scores = runner.score(batch())
        assert time.monotonic() - start < 30  # abandoned at its deadline, not waited for (it sleeps 60 s)
    assert scores.raw["sleeps"] == [-1.0] * 4 and scores.num_timed_out == {"sleeps": 4, "length": 0}
    assert scores.raw["length"] == [1.0, 3.0, 2.0, 1.0]
