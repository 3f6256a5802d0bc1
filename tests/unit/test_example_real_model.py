"""examples/real-model: the committed files are what make_data.py writes, the evaluation problems are held out, and
the reward reads the last number of a completion."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

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
