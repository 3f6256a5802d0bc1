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


def test_the_demonstrations_are_the_ids_and_masks_the_turn_loop_builds():
    """make_model.py's demonstration rows, rendered by `fsdptrain sft`'s own loader, are token for token what a
    multi-turn rollout with the tool holds: the prompt with the tool listed, the call and its EOS (trained), the
    tool's segment (not trained), the answer and its EOS (trained); without tools, the prompt and the answer."""
    import random
    import sys
    from pathlib import Path

    from fsdptrain.data.demonstrations import DemoKeys, demonstration_ids

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "calculator"))
    from make_model import Demonstrations, build_tokenizer, chat, demonstrations

    tok = build_tokenizer()
    made = Demonstrations(tok)
    row = {"prompt": [{"role": "user", "content": "47*83=?"}], "answer": "3901"}
    prompt, plain = made.tools.prompt_ids(row["prompt"]), made.plain.prompt_ids(row["prompt"])
    call, segment, answer = made.call_ids(row), made.segment_ids(row), made.answer_ids(row)
    assert len(call) == 8 and len(answer) == 5 and tok.decode(segment).count("3901") == 1
    cases = {(True, True): (prompt, call + segment + answer, [1] * 8 + [0] * len(segment) + [1] * 5),
             (True, False): (prompt, answer, [1] * 5), (False, False): (plain, answer, [1] * 5)}
    for (tools, calls), want in cases.items():
        demo = chat(row, tools=tools, call=calls)
        got = demonstration_ids(demo, list(demo), tokenizer=tok, keys=DemoKeys())
        assert got == want, (tools, calls)
    rows = demonstrations(random.Random(1), 400, call_share=0.5)
    with_tools = [r for r in rows if "tools" in r]
    calling = [r for r in with_tools if len(r["messages"]) == 4]
    assert 0.7 < len(with_tools) / 400 < 0.8 and 0.4 < len(calling) / len(with_tools) < 0.6


@pytest.mark.slow
def test_the_readme_commands_run(tmp_path):
    """A smoke run of examples/calculator/README.md's commands, shortened (64 demonstrations, 2 warm-up steps, 1 RL
    step): the model and the demonstrations are written, `fsdptrain sft` warms the model up and exports it, the
    measurement reads the export, and the RL step runs from it with the tool and logs its metrics (slow: an
    end-to-end run, about 40 s)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import run_cli

    root = Path(__file__).resolve().parents[2]
    work, warm = tmp_path / "work", tmp_path / "warmup"
    subprocess.run([sys.executable, "examples/calculator/make_model.py", "--out", str(work), "--demos", "64"],
                   cwd=root, check=True, capture_output=True, timeout=600)
    result = run_cli("sft", f"model.path={work / 'model'}", f"data.path={work / 'demos.jsonl'}",
                     f"data.eval_path={work / 'demos_eval.jsonl'}", "sft.rows_per_step=32", "trainer.steps=2",
                     "trainer.lr=1e-3", "trainer.warmup_steps=50", "trainer.lr_schedule=cosine",
                     "trainer.min_lr_ratio=0.1", "trainer.token_budget=4096", "trainer.eval_every=100",
                     f"trainer.run_dir={warm}", "logging.progress=false", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = subprocess.run([sys.executable, "examples/calculator/make_model.py", "--out", str(work), "--measure",
                               str(warm / "export" / "policy")], cwd=root, check=True, capture_output=True,
                              text=True, timeout=600)
    assert "p_call" in measured.stdout and "call_copies_factors" in measured.stdout
    result = run_cli("train", "model=local", f"model.path={warm / 'export' / 'policy'}", "algorithm=grpo",
                     "data=prompts", f"data.path={work / 'train.jsonl'}", f"data.eval_path={work / 'eval.jsonl'}",
                     "rollout.tools=[examples/calculator/calculator.py:calculate]",
                     "reward.functions=[examples/calculator/reward.py:exact_answer]", "rollout.max_new_tokens=48",
                     "rollout.max_turns=2", "rollout.n=2", "rollout.prompts_per_step=2", "trainer.steps=1",
                     "trainer.eval_every=0", f"trainer.run_dir={tmp_path / 'run'}", "logging.progress=false", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "tools/call_frequency" in row and "reward/exact_answer/mean" in row
