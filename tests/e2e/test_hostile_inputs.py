"""Hostile inputs through the real CLI (issue 32): folders, names, configs, model folders and checkpoints the user
brings. Each case exits 2 with one line naming the culprit, no traceback, and leaves the user's files as they were.
The table of simpler bad inputs is tests/e2e/test_bad_inputs.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import cli_command, run_cli

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


def _laughs(levels: int) -> str:
    """A config file of ``levels`` nested lists of nine aliases each (9^levels values from a few hundred bytes)."""
    lines = ["defaults:", "  - config", "  - _self_", 'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _string_chain(fields: list[str], fanout: int) -> str:
    """A config file whose string fields each name the previous one ``fanout`` times (fanout^len characters)."""
    groups: dict[str, list[str]] = {}
    for i, key in enumerate(fields):
        group, name = key.split(".")
        value = "lol" if i == 0 else f"${{{fields[i - 1]}}}" * fanout
        groups.setdefault(group, []).append(f"  {name}: '{value}'")
    return "defaults:\n  - config\n  - _self_\n" + "".join(f"{g}:\n" + "\n".join(v) + "\n" for g, v in groups.items())


CHAIN = ["model.value_init", "algorithm.kl_estimator", "data.prompt_key", "reward.model_normalize",
         "rollout.gather_weights", "trainer.lr_schedule", "parallel.compile_backend", "drafter.export_dtype",
         "sft.messages_key", "trainer.run_name"]


@pytest.mark.parametrize(("text", "args", "culprit"), [
    (_laughs(9), (), "mine.yaml: its YAML aliases expand to"),
    (_string_chain(CHAIN, 10), (),
     "trainer.run_name: its interpolations (${...}) expand to about 3000000000 characters"),
    (_string_chain(CHAIN[:3], 100), ("trainer.run_name=" + "${data.prompt_key}" * 100,),  # the override multiplies
     "trainer.run_name: its interpolations (${...}) expand to about 3000000 characters"),
    ("defaults:\n  - config\n  - _self_\ntrainer:\n  run_name: a${trainer.run_dir}\n  run_dir: b${trainer.run_name}\n",
     (), "refer back to themselves"),
])
def test_a_config_built_to_expand_without_bound_is_one_line_in_bounded_time(tmp_path, text, args, culprit):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.yaml").write_text(text)
    result = run_cli("train", "--config-dir", "d", "--config-name", "mine", *args, cwd=tmp_path, timeout=120)
    line = one_error_line(result)
    assert culprit in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_searchpath_folder_of_the_users_is_checked_the_same(tmp_path):
    (tmp_path / "extra" / "algorithm").mkdir(parents=True)
    (tmp_path / "extra" / "algorithm" / "lol.yaml").write_text(_laughs(9).split("_self_\n", 1)[1])
    result = run_cli("train", f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "algorithm=lol", cwd=tmp_path,
                     timeout=120)
    assert "algorithm/lol.yaml: its YAML aliases expand to" in one_error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra"]


EVIL_CODE = """
from pathlib import Path
Path({marker!r}).write_text("the folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


def _folder_with_custom_code(folder: Path, marker: Path, *, reward_model: bool = False) -> Path:
    """A tiny model folder whose config.json names its own code (auto_map): importing evil.py writes ``marker``."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    tokenizer = load_bundled_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    (LlamaForSequenceClassification if reward_model else LlamaForCausalLM)(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    meta = json.loads((folder / "config.json").read_text())
    kind = "AutoModelForSequenceClassification" if reward_model else "AutoModelForCausalLM"
    meta["auto_map"] = {"AutoConfig": "evil.EvilConfig", kind: "evil.EvilModel"}
    meta["model_type"] = "evil"  # a type transformers does not know: only the folder's code could load it
    (folder / "config.json").write_text(json.dumps(meta))
    (folder / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
    return folder


@pytest.mark.parametrize("role", ["policy", "reward-model"])
def test_a_model_folder_with_its_own_code_is_refused_without_running_it_or_asking(tmp_path, role):
    marker = tmp_path / "code-ran"
    folder = _folder_with_custom_code(tmp_path / "m", marker, reward_model=role == "reward-model")
    args = (("model=local", f"model.path={folder}") if role == "policy" else
            ("algorithm=grpo", f"reward.models=[{folder}]"))
    result = subprocess.run([*cli_command(), "train", *TINY, "trainer.steps=1", *args], cwd=tmp_path,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    line = one_error_line(result)
    assert "config.json has an auto_map" in line and "does not run model code from folders" in line, line
    assert str(folder) in line, line
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_every_load_refuses_a_folders_code_even_past_the_check(tmp_path):
    from fsdptrain.model.loading import resolve_config

    marker = tmp_path / "code-ran"
    folder = _folder_with_custom_code(tmp_path / "m", marker)
    with pytest.raises(ValueError, match="trust_remote_code"):
        resolve_config(path=str(folder), config=None)
    assert not marker.exists()


# ---- the user's reward file (items 3 and 4) ----------------------------------------------------------------------

REWARD_FILE = """\
import os, time

import helpers  # a module next to this file, as `python task/rw.py` would find it


def length(prompts, completions, completion_ids, **kwargs):
    return [helpers.score(c) for c in completions]


def hang(prompts, completions, completion_ids, **kwargs):
    open(os.path.join(os.path.dirname(__file__), f"pid_{os.getpid()}"), "w").close()
    time.sleep(600)
"""


def _task_folder(root: Path) -> Path:
    task = root / "task"
    task.mkdir()
    (task / "helpers.py").write_text("def score(c):\n    return float(len(c))\n")
    (task / "rw.py").write_text(REWARD_FILE)
    (task / "no_module.py").write_text("import no_such_module\n")
    (task / "exits.py").write_text("import sys\n\nCONST = 1\nsys.exit(3)\n")
    return task


def test_a_reward_file_that_fails_to_import_is_one_line_and_nothing_is_written(tmp_path):
    task = _task_folder(tmp_path)
    before = sorted(p.name for p in task.iterdir())
    for spec, culprit in [
        ("task/no_module.py:f", "importing 'task/no_module.py' failed at line 1: ModuleNotFoundError: No module "
                                "named 'no_such_module' (from 'task/no_module.py:f')"),
        ("task/exits.py:f", "importing 'task/exits.py' failed at line 4: it called sys.exit(3)"),
    ]:
        line = one_error_line(run_cli("train", *TINY, "trainer.steps=1", f"reward.functions=[{spec}]", cwd=tmp_path))
        assert culprit in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task"]  # no run folder
    assert sorted(p.name for p in task.iterdir()) == before  # not even a __pycache__


def test_check_reward_imports_a_sibling_module_and_bounds_every_call(tmp_path):
    # Workers import rw.py (and helpers.py next to it) before their first call; `hang` times out at 3 s on every call
    # and check-reward makes no call of its own without that deadline (it used to call each function once more).
    task = _task_folder(tmp_path)
    result = subprocess.run(
        [*cli_command(), "check-reward", "logging.progress=false", "rollout.prompts_per_step=2", "rollout.n=2",
         "rollout.max_new_tokens=4", "reward.functions=[task/rw.py:length,task/rw.py:hang]",
         "reward.num_workers=2", "reward.timeout_s=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)  # safety net: the run takes seconds
    assert result.returncode in (0, 1), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "length " in result.stdout and "hang: every call timed out" in result.stdout, result.stdout
    pids = [int(p.name[4:]) for p in task.glob("pid_*")]
    assert len(pids) >= 2  # one call per prompt group, each in a worker that was killed at its deadline
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()
                and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()]


@pytest.mark.slow  # CI time; tests/unit/test_tokenizer_checks.py covers the check
def test_a_chat_template_that_fails_on_the_datas_roles_is_one_line_before_any_model(tmp_path):
    # The tokenizer checks (no pad nor EOS, more tokens than the embedding) are tests/unit/test_tokenizer_checks.py.
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    folder = tmp_path / "m"
    tokenizer = load_bundled_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] != 'user' %}"
                               "{{ raise_exception('only user messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [[{"role": "user", "content": "repeat 1"}], [{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": "repeat 2"}]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": r, "answer": "1"}) + "\n" for r in rows))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = run_cli("train", *TINY, "trainer.steps=1", "model=local", f"model.path={folder}", "data=prompts",
                     "data.path=train.jsonl", "data.num_eval_prompts=0", "reward.functions=[exact_match]",
                     "trainer.run_name=chat", cwd=tmp_path)
    line = one_error_line(result)
    assert line == ("error: train.jsonl: row 1 (0-based), column 'prompt': the tokenizer's chat template fails on this "
                    "chat (roles system, user): TemplateError: only user messages"), line
    assert "policy:" not in result.stdout  # no model was built (its line comes first once one is)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not (tmp_path / "runs").exists()  # the rows are read before the run folder is claimed


# ---- checks that can run before the run folder is claimed run before it (issue 42, class 6) ----------------------

OFFLINE_ROW = {"prompt": "what is 2+2?", "response": "four", "reward": 1.0, "group": 0}
OFFLINE = ("data=jsonl", "data.path=rows.jsonl", "rollout.max_new_tokens=8", "rollout.prompts_per_step=1")


@pytest.mark.parametrize(("rows", "args", "culprit"), [
    ([{**OFFLINE_ROW, "response_mask": [1] * 9}], OFFLINE,
     "rows.jsonl:1: 'response_mask' has 9 entries for 2 response tokens (EOS included)"),
    ([OFFLINE_ROW, {**OFFLINE_ROW, "response_mask": [0, 2]}], OFFLINE,
     "rows.jsonl:2: 'response_mask' must be a list of 0s and 1s, got [0, 2]"),
    ([OFFLINE_ROW, {**OFFLINE_ROW, "response_mask": [0, 0]}], ("--nproc", "2", *OFFLINE, "rollout.prompts_per_step=2"),
     "rows.jsonl:2: 'response_mask' has no 1"),
    ([OFFLINE_ROW], (*OFFLINE, "trainer.token_budget=3"),
     "trainer.token_budget=3 is smaller than a sequence of 6 tokens (prompt + response) in data.path"),
    ([], ("trainer.token_budget=7",), "trainer.token_budget=7 is smaller than a sequence of 8 tokens this run can "
                                      "make (its longest prompt, 4 tokens, + rollout.max_new_tokens=4)"),
    ([], ("--nproc", "2", "trainer.token_budget=7"), "raise trainer.token_budget to at least 8"),
    ([{"prompt": "2+2", "answer": "4"}, {"prompt": "", "answer": "1"}],
     ("data=prompts", "data.path=rows.jsonl", "data.num_eval_prompts=0", "reward.functions=[exact_match]"),
     "rows.jsonl: row 1 (0-based), column 'prompt': empty prompt"),
])
def test_a_bad_row_or_a_budget_below_a_sequence_leaves_no_run_folder(tmp_path, rows, args, culprit):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = one_error_line(run_cli("train", *TINY, "trainer.steps=1", *args, "trainer.run_name=r", cwd=tmp_path))
    assert culprit in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]  # no runs/ at all


# ---- several ranks (item 8) and a stop signal during a hung reward call (item 4) ----------------------------------

RANK_FILE = """\
import os, sys, time


def leaves_on_rank_1(prompts, completions, completion_ids, **kwargs):
    if os.environ["RANK"] == "1":
        print("rank 1: the reward's own last words", file=sys.stderr, flush=True)
        os._exit(7)  # a process that ends without an exception (a crash in a C extension looks the same)
    return [1.0] * len(completions)


def hangs_on_rank_1(prompts, completions, completion_ids, **kwargs):
    if os.environ["RANK"] == "1":
        open(os.path.join(os.path.dirname(__file__), "ready"), "w").close()
        time.sleep(600)
    return [1.0] * len(completions)
"""


@pytest.mark.slow  # two 2-rank runs, ~15 s each on a quiet machine
def test_a_failure_on_one_rank_ends_every_rank_with_that_ranks_message_only(tmp_path):
    import os
    import signal
    import time

    (tmp_path / "rw.py").write_text(RANK_FILE)
    args = ["train", "--nproc", "2", *TINY, "trainer.steps=2", "reward.functions=[rw.py:leaves_on_rank_1]"]
    result = run_cli(*args, "trainer.run_name=crash", cwd=tmp_path)
    # the call's exit is caught and named (docs/your-task.md): rank 1's line, exit 2, no gloo error
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0] == "rank 1: the reward's own last words", result.stderr[-3000:]
    assert re.fullmatch(r"error: reward function 'leaves_on_rank_1' on row \d+ \(0-based\): called os._exit\(7\) "
                        r"\(a reward function returns its values; it must not exit\) \(the call covered \d+ "
                        r"samples\)", lines[1]), lines[1]

    # SIGTERM while rank 1's reward call hangs: rank 0 stops in its next collective, rank 1 after the grace (10 s);
    # the launcher reports rank 1's line once and exits 128 + SIGTERM.
    args[-1] = "reward.functions=[rw.py:hangs_on_rank_1]"
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([*cli_command(), *args, "trainer.run_name=hang"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=err, text=True)
    try:
        deadline = time.monotonic() + 300  # safety net: `ready` appears once rank 1's call runs
        while not (tmp_path / "ready").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "ready").exists()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)  # safety net: the grace is 10 s
    finally:
        proc.kill()
    err.seek(0)
    stderr = err.read()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert stderr.strip() == (
        "error: SIGTERM: a call of the reward functions 'hangs_on_rank_1' did not return within 10 s of the signal; "
        "stopped without saving this step (the last checkpoint stays)"), stderr[-3000:]
    assert not (tmp_path / "runs" / "hang" / "checkpoints").exists()
