"""examples/calculator: the tool evaluates arithmetic safely (no names, calls or attributes reach Python), the reward
is an exact match on the final assistant turn."""

from __future__ import annotations

import pytest

from fsdptrain.registry.user_functions import load_callable

calculate = load_callable("examples/calculator/calculator.py:calculate", what="test")
exact_answer = load_callable("examples/calculator/reward.py:exact_answer", what="test")


def test_calculate_evaluates_arithmetic():
    assert calculate("47*83") == "3901"
    assert calculate(" (2 + 3) * -4 ") == "-20"
    assert calculate("7/2") == "3.5" and calculate("8/2") == "4" and calculate("2**10") == "1024"


@pytest.mark.parametrize("expression", ["__import__('os')", "x", "(1).real", "[1]", "2**1000", "1 +", "'a'*3"])
def test_calculate_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_exact_answer_reads_the_last_assistant_turn():
    call = {"role": "assistant", "content": "...", "tool_calls": [{"type": "function", "function": {}}]}
    completions = [[call, {"role": "tool", "content": "3901"}, {"role": "assistant", "content": "3901"}],
                   [call, {"role": "tool", "content": "3901"}],
                   "3901", "3900"]
    assert exact_answer([""] * 4, completions, [[]] * 4, answer=["3901"] * 4) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.slow
def test_the_readme_commands_run(tmp_path):
    """A smoke run of examples/calculator/README.md's commands, shortened (2 warm-up steps, 1 RL step): the model is
    written and the RL step runs with the tool and logs its metrics (slow: an end-to-end run, 16 s)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import run_cli

    root = Path(__file__).resolve().parents[2]
    work = tmp_path / "work"
    subprocess.run([sys.executable, "examples/calculator/make_model.py", "--out", str(work), "--steps", "2"],
                   cwd=root, check=True, capture_output=True, timeout=600)
    result = run_cli("train", "model=local", f"model.path={work / 'model'}", "algorithm=grpo", "data=prompts",
                     f"data.path={work / 'train.jsonl'}", f"data.eval_path={work / 'eval.jsonl'}",
                     "rollout.tools=[examples/calculator/calculator.py:calculate]",
                     "reward.functions=[examples/calculator/reward.py:exact_answer]", "rollout.max_new_tokens=48",
                     "rollout.max_turns=2", "rollout.n=2", "rollout.prompts_per_step=2", "trainer.steps=1",
                     "trainer.eval_every=0", f"trainer.run_dir={tmp_path / 'run'}", "logging.progress=false", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "tools/call_frequency" in row and "reward/exact_answer/mean" in row
