"""The digit tasks as datasets: word_match on the answer column equals today's tasks.reward on random samples."""

import random

import pytest

from fsdptrain.config import ConfigError
from fsdptrain.data.prompt_tasks import DIGIT_TASKS, digit_task_rows, write_jsonl
from fsdptrain.data.prompts import load_prompts
from fsdptrain.data.tokenizer import WORDS, load_bundled_tokenizer
from fsdptrain.rewards import word_match
from tests.helpers.digit_tasks_oracle import TASKS, answer_from_prompt, reward


@pytest.mark.parametrize("task", sorted(TASKS))
def test_word_match_reproduces_the_task_reward(task):
    rows = digit_task_rows(task, num_rows=300, seed=7)
    rng = random.Random(task)
    prompts, completions, answers, expected = [], [], [], []
    for row in rows:
        gold = answer_from_prompt(row["prompt"], TASKS[task])
        assert row["answer"] == " ".join(gold)
        for _ in range(5):  # random completions, some built from the answer so every score level occurs
            words = [rng.choice(WORDS) for _ in range(rng.randrange(0, 6))]
            if rng.random() < 0.5:
                words = [w if rng.random() < 0.6 else rng.choice(WORDS) for w in gold] + words[:rng.randrange(3)]
            completion = (" " if rng.random() < 0.2 else "") + " ".join(words)
            prompts.append(row["prompt"])
            completions.append(completion)
            answers.append(row["answer"])
            expected.append(reward(completion, gold))
    got = word_match(prompts=prompts, completions=completions, completion_ids=[[0]] * len(prompts), answer=answers)
    assert got == expected
    assert set(expected) == {0.0, 1 / 3, 2 / 3, 1.0}  # every answer has 3 words; every score level occurs


def test_rows_are_seeded_and_cover_the_prompt_space():
    assert digit_task_rows("sort_digits", num_rows=20, seed=1) == digit_task_rows("sort_digits", num_rows=20, seed=1)
    assert digit_task_rows("sort_digits", num_rows=20, seed=1) != digit_task_rows("sort_digits", num_rows=20, seed=2)
    assert {r["prompt"] for r in digit_task_rows("repeat_digit", num_rows=200, seed=0)} == {
        f"repeat {d} =" for d in range(10)}
    assert digit_task_rows("reverse_digits", num_rows=1, seed=0)[0]["prompt"].startswith("reverse ")
    assert set(DIGIT_TASKS) == set(TASKS)
    with pytest.raises(ConfigError, match="task='add' is not a bundled task"):
        digit_task_rows("add", num_rows=1, seed=0)


def test_written_rows_load_as_a_prompt_dataset(tmp_path):
    rows = digit_task_rows("copy_digits", num_rows=5, seed=3)
    loaded = load_prompts(str(write_jsonl(rows, tmp_path / "copy.jsonl")), tokenizer=load_bundled_tokenizer())
    assert [(r.text, r.columns) for r in loaded] == [(r["prompt"], {"answer": r["answer"]}) for r in rows]
