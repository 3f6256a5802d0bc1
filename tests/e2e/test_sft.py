"""``fsdptrain sft`` end to end (docs/sft.md), the real CLI on a tiny model written here with a character-level
ChatML tokenizer (tests/helpers/chatml_tokenizer.py): it trains (the loss falls, eval/loss is logged); 2 steps then a
resume to 3 equal 3 uninterrupted steps; 2 ranks equal 1; the export is a folder ``fsdptrain train`` trains from; a bad
row or a setting that does not apply is one line, exit 2, and no run folder."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, metric_kinds, run_cli, without_diagnostics
from tests.helpers.chatml_tokenizer import chatml_tokenizer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOL_CHAT = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"},
             {"role": "assistant", "content": CALL}, {"role": "tool", "name": "add", "content": "5"},
             {"role": "assistant", "content": "5"}]


def chat(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from tests.helpers.tiny_llama import tiny_llama

    folder = tmp_path_factory.mktemp("sft")
    tokenizer = chatml_tokenizer()
    tiny_llama(len(tokenizer), max_position_embeddings=512).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = [{"messages": TOOL_CHAT}, {"prompt": "7+1=", "completion": "8"}] + [chat(a, b) for a in range(3)
                                                                                for b in range(2)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "eval.jsonl").write_text("".join(json.dumps(chat(a, 3)) + "\n" for a in range(2)))
    return folder


def sft_args(folder: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["sft", f"model.path={folder / 'model'}", f"data.path={folder / 'train.jsonl'}",
            f"data.eval_path={folder / 'eval.jsonl'}", "sft.rows_per_step=4", "trainer.token_budget=256",
            "trainer.eval_every=1", "trainer.lr=1e-2", "logging.progress=false", f"trainer.run_dir={run_dir}",
            *extra]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def assert_same(got: dict, want: dict, kinds: dict, tol: float = 1e-6) -> None:
    got, want = without_diagnostics(got, kinds), without_diagnostics(want, kinds)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=tol, abs_tol=tol), (got["step"], key, got[key], want[key])


@pytest.fixture(scope="module")
def reference(inputs) -> Path:
    """3 uninterrupted steps, 2 mini-batches (optimizer steps) per step."""
    run_dir = inputs / "reference"
    done = run_cli(*sft_args(inputs, run_dir, "trainer.steps=3", "trainer.mini_batches_per_step=2"), cwd=inputs)
    assert done.returncode == 0, done.stderr
    return run_dir


def test_sft_trains_and_logs_typed_metrics(reference):
    rows, kinds = read_metrics(reference), metric_kinds(reference)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["sft/loss"] < rows[0]["sft/loss"] and rows[-1]["eval/loss"] < rows[0]["eval/loss"]
    assert kinds["sft/loss"] == "loss" and kinds["sft/nll"] == "mean" and kinds["eval/loss"] == "mean"
    assert kinds["sft/lr"] == "max" and kinds["batch/num_trained_tokens"] == "sum"
    for row in rows:  # token-mean: the loss is the mean NLL per trained token; 4 rows per step
        assert row["batch/num_seqs"] == 4 and row["sft/lr"] == pytest.approx(1e-2)
        assert row["eval/num_tokens"] == 4  # two one-digit answers and their EOS
    assert (reference / "export" / "policy" / "config.json").exists()


def test_resume_equals_uninterrupted_run(inputs, reference):
    run_dir = inputs / "resumed"
    first = run_cli(*sft_args(inputs, run_dir, "trainer.steps=2", "trainer.mini_batches_per_step=2",
                              "checkpoint.every=1"), cwd=inputs)
    assert first.returncode == 0, first.stderr
    again = run_cli(*sft_args(inputs, run_dir, "trainer.steps=3", "trainer.mini_batches_per_step=2",
                              "checkpoint.every=1", "trainer.resume=auto", "trainer.allow_config_change=true"),
                    cwd=inputs)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr + again.stdout
    got, want, kinds = read_metrics(run_dir), read_metrics(reference), metric_kinds(reference)
    assert [r["step"] for r in got] == [0, 1, 2]
    for g, w in zip(got, want):
        assert_same(g, w, kinds)


def test_two_ranks_equal_one(inputs, reference):
    run_dir = inputs / "two_ranks"
    done = run_cli(*sft_args(inputs, run_dir, "trainer.steps=2", "trainer.mini_batches_per_step=2"), "--nproc", "2",
                   cwd=inputs)
    assert done.returncode == 0, done.stderr
    kinds = metric_kinds(reference)
    for g, w in zip(read_metrics(run_dir), read_metrics(reference)[:2]):
        assert_same(g, w, kinds, tol=1e-5)


def test_export_is_a_model_train_starts_from(inputs, reference):
    run_dir = inputs / "rl_from_export"
    done = run_cli("train", f"model.path={reference / 'export' / 'policy'}", "algorithm=grpo", "trainer.steps=1",
                   "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
                   "logging.progress=false", f"trainer.run_dir={run_dir}", cwd=inputs)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [0]


@pytest.mark.parametrize("case", ["no_assistant", "too_long", "template", "reward", "rollout"])
def test_bad_data_and_settings_are_one_line_exit_2_nothing_written(inputs, case):
    model, data, extra = inputs / "model", inputs / f"{case}.jsonl", []
    rows = [chat(1, 1)]
    if case == "no_assistant":
        rows.append({"messages": [{"role": "user", "content": "Hi"}]})
        want = "row 1 (0-based): it has no assistant message"
    elif case == "too_long":
        rows.append({"messages": TOOL_CHAT})
        extra, want = ["trainer.token_budget=100"], "row 1 (0-based) is 169 tokens, more than trainer.token_budget=100"
    elif case == "template":
        model = inputs / "model_no_tool_role"
        if not model.exists():
            shutil.copytree(inputs / "model", model)
            tokenizer = chatml_tokenizer("{% for m in messages %}{% if m.role == 'tool' %}"
                                         "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
                                         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
            tokenizer.save_pretrained(model)
        rows.append({"messages": TOOL_CHAT})
        want = "row 1 (0-based): the tokenizer's chat template cannot render this chat"
    elif case == "reward":
        extra, want = ["reward.functions=[exact_match]"], "reward.functions="
    else:
        extra, want = ["rollout.n=8"], "rollout.n=8 does not apply to fsdptrain sft"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = inputs / f"bad_{case}"
    done = run_cli("sft", f"model.path={model}", f"data.path={data}", f"trainer.run_dir={run_dir}", *extra,
                   cwd=inputs)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], done.stderr
    assert not run_dir.exists()


# CI budget: 2 ranks marked slow; the ranks=2 layout of 2-rank training is covered by test_two_ranks_equal_one
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_check_metrics_passes_on_sft_and_fails_the_per_micro_batch_mean(inputs, nproc):
    """Packed vs per-sequence vs padded, micro-batch splits, budgets, simulated dp and the real ranks: the loss, the
    gradient and every metric equal; a micro-batch normalised by its own token count fails it."""
    args = ["check-metrics", "data=sft", f"model.path={inputs / 'model'}", f"data.path={inputs / 'train.jsonl'}",
            "sft.rows_per_step=8", "trainer.token_budget=256", "--nproc", str(nproc)]
    good = run_cli(*args, "--json", str(inputs / f"good{nproc}.json"), cwd=inputs)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    report = json.loads((inputs / f"good{nproc}.json").read_text())
    assert f"ranks={nproc}" in report["layouts_run"] and "padded" in report["layouts_run"]
    assert "micro-batches=8 (one sequence each)" in report["layouts_run"]
    patch = inputs / "patch"
    patch.mkdir(exist_ok=True)
    (patch / "sitecustomize.py").write_text("from tests.helpers.planted_bugs import "
                                           "plant_micro_batch_normalised_by_its_own_tokens\n"
                                           "plant_micro_batch_normalised_by_its_own_tokens()\n")
    env = {"PYTHONPATH": os.pathsep.join([str(patch), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    bad = run_cli(*args, "--json", str(inputs / f"bad{nproc}.json"), cwd=inputs, env=env)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    failures = json.loads((inputs / f"bad{nproc}.json").read_text())["failures"]
    assert any("sft/loss" in f and "micro-batches=8" in f for f in failures), failures
    assert any("sft/grad_max_diff" in f for f in failures), failures
