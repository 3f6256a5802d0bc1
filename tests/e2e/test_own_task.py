"""Training on a user's own task through the real CLI: a user folder (model, chat tokenizer, prompts, reward file),
exact resume of the prompt order and metrics, bad inputs, slow rewards, and no orphan reward processes.

The user folder is written by the test: a tiny Llama saved with ``save_pretrained``, the bundled tokenizer given a
chat template and saved, a JSONL of chat prompts with ``answer`` and ``kind`` columns, and ``rewards.py`` with two
functions (``short`` returns None for rows of kind ``skip``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import cli_command, metric_kinds
from tests.e2e.test_resume_export import assert_same_metrics, read_metrics

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %} ={% endif %}")
REWARDS = '''\
import os, time


def match(prompts, completions, completion_ids, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer):
        words, gold = c.split(), a.split()
        out.append(sum(1 for i, w in enumerate(gold) if i < len(words) and words[i] == w) / len(gold))
    return out


def short(prompts, completions, completion_ids, kind, **kwargs):
    return [None if k == "skip" else float(len(ids) <= 3) for k, ids in zip(kind, completion_ids)]


def boom(prompts, completions, completion_ids, **kwargs):
    counter = os.path.join(os.path.dirname(__file__), "calls")
    calls = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
    open(counter, "w").write(str(calls))
    if calls == 3:
        raise KeyError("no_such_key")
    return [0.0] * len(completions)


def zero(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def slow(prompts, completions, completion_ids, **kwargs):
    open(os.path.join(os.path.dirname(__file__), f"pid_{os.getpid()}"), "w").close()
    time.sleep(60)
    return [1.0] * len(completions)
'''
USER = ("model=local", "data=prompts", "algorithm=grpo", "rollout.prompts_per_step=4", "rollout.n=2",
        "rollout.max_new_tokens=4", "trainer.eval_every=0", "logging.progress=false", "data.num_eval_prompts=0")


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    from fsdptrain.data.tokenizer import load_bundled_tokenizer
    from tests.helpers.tiny_llama import tiny_llama

    folder = tmp_path_factory.mktemp("user")
    tokenizer = load_bundled_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_llama(len(tokenizer)).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = [{"prompt": [{"role": "user", "content": f"repeat {d}"}], "answer": f"{d} {d} {d}",
             "kind": "skip" if d % 3 == 0 else "short"} for d in range(10)] * 3
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "rewards.py").write_text(REWARDS)
    return folder


def user_args(folder: Path, *extra: str, functions: str = "match,short") -> list[str]:
    return [*USER, f"model.path={folder / 'model'}", f"data.path={folder / 'train.jsonl'}",
            f"reward.functions=[{','.join(f'{folder}/rewards.py:{f}' for f in functions.split(','))}]", *extra]


def read_samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ---- training from the user folder, and exact resume ----------------------------------------------------------------


@pytest.mark.slow  # CI budget: the user folder trains in the other tests here; exact resume: tests/e2e/test_resume_export.py
@pytest.mark.parametrize("nproc", [1, 2])
def test_user_folder_trains_and_resumes_exactly(cli, tmp_path, user_folder, nproc):
    args = user_args(user_folder, "trainer.steps=3", "checkpoint.every=2", "logging.samples_every=1")
    full = tmp_path / "runs" / "full"
    result = cli("train", "--nproc", str(nproc), *args, "trainer.run_name=full")
    assert result.returncode == 0, result.stderr
    assert "samples at step 0" in result.stdout
    rows = read_metrics(full)
    assert len(rows) == 3
    for key in ("reward/match/mean", "reward/short/mean", "reward/mean", "reward/std",
                "reward/all_equal_group_share", "data/epoch"):
        assert key in rows[0], key
    samples = read_samples(full)
    assert {s["step"] for s in samples} == {0, 1, 2}
    for s in samples:  # None (kind skip) is left out of the total, not counted as 0
        applied = [v for v in s["rewards"].values() if v is not None]
        assert s["total"] == pytest.approx(sum(applied))
        assert (s["rewards"]["short"] is None) == (int(s["prompt"].split()[1]) % 3 == 0)
    assert rows[2]["data/epoch"] == pytest.approx(12 / 30)

    resumed = tmp_path / "runs" / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    result = cli("train", "--nproc", str(nproc), *args, "trainer.run_name=resumed", "trainer.resume=auto")
    assert result.returncode == 0, result.stderr
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [2]
    assert_same_metrics(again[0], rows[2], metric_kinds(full))
    assert read_samples(resumed) == [s for s in samples if s["step"] == 2]


def test_epochs_set_the_number_of_steps(cli, tmp_path, user_folder):
    # 30 rows, 4 prompts a step: 0.5 epochs = ceil(15 / 4) = 4 steps
    result = cli("train", *user_args(user_folder, "trainer.epochs=0.5"), "trainer.run_name=ep")
    assert result.returncode == 0, result.stderr
    assert len(read_metrics(tmp_path / "runs" / "ep")) == 4


# ---- bad inputs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, fragment", [
    ("data.path=openai/gsm8k", "data.path='openai/gsm8k': no such file or folder"),
    ("data.path=https://example.com/train.jsonl", "only local files are read"),
    ("reward.functions=[no_such_file.py:f]", "no_such_file.py"),
    ("reward.functions=[REWARDS:nothing_here]", "nothing_here"),
    ("logging.backends=[jsonl,nope]", "logging.backends: 'nope' is not a valid choice"),
    ("trainer.epochs=1", "trainer.steps=2 and trainer.epochs=1.0 are both set"),
])
def test_bad_input_is_one_line_before_any_rank(cli, tmp_path, user_folder, override, fragment):
    override = override.replace("REWARDS", str(user_folder / "rewards.py"))
    result = cli("train", *user_args(user_folder, "trainer.steps=2"), override, "trainer.run_name=bad")
    assert result.returncode == 2, result.stderr
    assert fragment in one_line_error(result)
    assert not (tmp_path / "runs").exists()


def test_missing_column_is_one_line_naming_file(cli, tmp_path, user_folder):
    result = cli("train", *user_args(user_folder, "trainer.steps=2"), "data.prompt_key=question")
    assert result.returncode == 2, result.stderr
    assert "train.jsonl: no column 'question' (data.prompt_key)" in one_line_error(result)


def test_reward_error_stops_with_the_users_traceback_and_keeps_the_checkpoint(cli, tmp_path, user_folder):
    folder = tmp_path / "user"
    shutil.copytree(user_folder, folder)
    args = user_args(folder, "trainer.steps=4", "checkpoint.every=1", functions="match,boom")
    result = cli("train", *args, "trainer.run_name=boom")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: reward function 'boom' on row ")
    assert "raised KeyError: 'no_such_key'" in lines[-1]
    assert 'raise KeyError("no_such_key")' in result.stderr  # the user's own traceback
    assert "fsdptrain/" not in result.stderr  # not ours
    run = tmp_path / "runs" / "boom"
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


# ---- slow rewards and the worker processes --------------------------------------------------------------------------


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        if "State:\tZ" not in state:
            alive.append(pid)
    return alive


def worker_pids(folder: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in folder.glob("pid_*")]


def test_slow_reward_is_cut_off_counted_and_its_workers_end(cli, tmp_path, user_folder):
    folder = tmp_path / "user"
    shutil.copytree(user_folder, folder)
    args = user_args(folder, "trainer.steps=1", "reward.num_workers=2", "reward.timeout_s=2",
                     "reward.timeout_score=0.25", functions="match,slow")
    result = cli("train", *args, "trainer.run_name=slow")
    assert result.returncode == 0, result.stderr
    row = read_metrics(tmp_path / "runs" / "slow")[0]
    assert row["reward/slow/num_timed_out"] == 8  # 4 groups x 2 samples
    assert row["reward/slow/mean"] == 0.25
    pids = worker_pids(folder)
    assert pids
    time.sleep(1.0)
    assert pids_alive(pids) == []


def test_ctrl_c_leaves_no_reward_worker_behind(tmp_path, user_folder):
    folder = tmp_path / "user"
    shutil.copytree(user_folder, folder)
    args = user_args(folder, "trainer.steps=1", "reward.num_workers=1", functions="match,slow")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*cli_command(), "train", *args, "trainer.run_name=ctrlc"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 180
    while not worker_pids(folder) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    pids = worker_pids(folder)
    assert pids, proc.communicate()
    # Ctrl-C reaches the whole process group; the first asks for a stop at the step boundary, the second stops at once
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    time.sleep(1.0)
    assert pids_alive(pids) == []


# ---- check-reward ---------------------------------------------------------------------------------------------------


def test_check_reward_passes_on_the_bundled_default(cli):
    result = cli("check-reward", "logging.progress=false")
    assert result.returncode == 0, result.stderr
    assert "word_match" in result.stdout and "all-equal groups" in result.stdout
    assert "ok: some prompt groups" in result.stdout


def test_check_reward_fails_when_every_group_is_all_equal(cli, user_folder):
    result = cli("check-reward", *user_args(user_folder, functions="zero"))
    assert result.returncode == 1, result.stderr
    assert "nothing to learn" in result.stdout
