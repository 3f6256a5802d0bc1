"""The bundled tokenizer, the tasks' rewards, the prompt stream and the offline JSONL reader."""

from __future__ import annotations

import json
import random

import pytest

from fsdptrain.data.offline_rollouts import DataError, load_jsonl_rollouts
from fsdptrain.data.rollout_record import split_response
from fsdptrain.data.tokenizer import TOKENIZER_PATH, build_tokenizer, load_bundled_tokenizer
from tests.helpers.digit_tasks_oracle import TASKS, answer_from_prompt, reward


def test_shipped_tokenizer_matches_its_builder():
    assert TOKENIZER_PATH.read_text() == build_tokenizer().to_str(pretty=True)


def test_tokenizer_round_trips_task_text():
    tok = load_bundled_tokenizer()
    ids = tok("copy 3 8 1 =")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "copy 3 8 1 ="
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_reward_is_positional_partial_credit():
    # answer 3 8 1: "3 8 7" gets 2 of 3 right; "8 1" is shifted, so 0 of 3; extra words are ignored.
    assert reward("3 8 7", ["3", "8", "1"]) == pytest.approx(2 / 3)
    assert reward("8 1", ["3", "8", "1"]) == 0.0
    assert reward("3 8 1 9 9", ["3", "8", "1"]) == 1.0
    assert reward("", ["3", "8", "1"]) == 0.0


@pytest.mark.parametrize("name, prompt, answer", [
    # seed 1 draws the digits 2 9 1 (distinct and unsorted, so every task's answer differs); answers by hand
    ("repeat_digit", "repeat 2 =", ["2", "2", "2"]),
    ("copy_digits", "copy 2 9 1 =", ["2", "9", "1"]),
    ("reverse_digits", "reverse 2 9 1 =", ["1", "9", "2"]),
    ("sort_digits", "sort 2 9 1 =", ["1", "2", "9"]),
])
def test_task_prompts_and_answers_by_hand(name, prompt, answer):
    assert TASKS[name].make_prompt(random.Random(1)) == (prompt, answer)
    assert answer_from_prompt(prompt, TASKS[name]) == answer


def test_task_answers_depend_on_the_prompt():
    assert TASKS["reverse_digits"].answer_of(["1", "2", "3"]) == ["3", "2", "1"]
    assert TASKS["sort_digits"].answer_of(["3", "1", "2"]) == ["1", "2", "3"]
    assert TASKS["repeat_digit"].make_prompt(random.Random(0))[0] == "repeat 6 ="
    assert TASKS["repeat_digit"].answer_of(["6"]) == ["6", "6", "6"]


def test_split_response_stops_at_first_eos_and_keeps_sampled_pads_of_truncated_rows():
    assert split_response([5, 6, 2, 0, 0], eos_id=2) == ([5, 6, 2], False)
    assert split_response([5, 0, 6], eos_id=2) == ([5, 0, 6], True)


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_jsonl_rollouts_group_and_eos(tmp_path):
    tok = load_bundled_tokenizer()
    path = tmp_path / "r.jsonl"
    _write(path, [
        {"prompt": "copy 1 2 3 =", "response": "1 2 3", "reward": 1.0, "group": "a"},
        {"prompt": "copy 1 2 3 =", "response": "1 2", "reward": 0.5, "group": "a", "truncated": True},
        {"prompt": "copy 4 4 4 =", "response": "4", "reward": 0.3, "behaviour_logprobs": [-0.1, -0.2]},
    ])
    rollouts, skipped = load_jsonl_rollouts(str(path), tok, max_response_length=8, skip_bad_rows=False)
    assert skipped == 0
    assert [r.group for r in rollouts] == [0, 0, 1]
    assert rollouts[0].response_ids[-1] == tok.eos_token_id and len(rollouts[0].response_ids) == 4
    assert rollouts[1].response_ids[-1] != tok.eos_token_id and rollouts[1].truncated
    assert rollouts[2].behaviour_logprobs == [-0.1, -0.2]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "invalid JSON"),
        ({"prompt": "copy 1 =", "response": "1"}, "'reward' must be a finite number"),
        ({"prompt": "copy 1 =", "response": "1", "reward": 1, "behaviour_logprobs": [0.0]}, "behaviour_logprobs"),
        ({"prompt": "copy 1 =", "response": "1 1 1 1 1 1 1 1 1", "reward": 1}, "rollout.max_new_tokens=8"),
        ({"prompt": "copy 1 =", "response": "1", "reward": 1, "response_mask": [1]}, "'response_mask' has 1 entries for 2"),
        ({"prompt": "copy 1 =", "response": "1", "reward": 1, "response_mask": [1, 2]}, "list of 0s and 1s, got [1, 2]"),
        ({"prompt": "copy 1 =", "response": "1", "reward": 1, "response_mask": [True, 1]}, "list of 0s and 1s"),
        ({"prompt": "copy 1 =", "response": "1", "reward": 1, "response_mask": "11"}, "list of 0s and 1s"),
        ({"prompt": "copy 1 =", "response": "1", "reward": 1, "response_mask": [0, 0]}, "no token of the policy"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, bad, message):
    tok = load_bundled_tokenizer()
    path = tmp_path / "r.jsonl"
    _write(path, [{"prompt": "copy 1 =", "response": "1", "reward": 1.0}, bad])
    with pytest.raises(DataError) as excinfo:
        load_jsonl_rollouts(str(path), tok, max_response_length=8, skip_bad_rows=False)
    assert f"{path}:2:" in str(excinfo.value) and message in str(excinfo.value)
    rollouts, skipped = load_jsonl_rollouts(str(path), tok, max_response_length=8, skip_bad_rows=True)
    assert (len(rollouts), skipped) == (1, 1)


def test_jsonl_response_mask_reaches_the_rollouts(tmp_path):
    """An offline multi-turn row keeps its tool-token holes: the mask is read, checked against the response's ids
    (EOS included) and handed on by the offline source; a row without one keeps None (all ones)."""
    from fsdptrain.config.compose import compose_config
    from fsdptrain.rollout.offline_source import OfflineSource

    path = tmp_path / "r.jsonl"
    _write(path, [{"prompt": "copy 1 2 =", "response": "1 9 2", "reward": 1.0, "response_mask": [1, 0, 1, 1]},
                  {"prompt": "copy 3 =", "response": "3", "reward": 0.0}])
    cfg = compose_config(["data=jsonl", f"data.path={path}", "rollout.max_new_tokens=8", "rollout.prompts_per_step=2"])
    source = OfflineSource(cfg, load_bundled_tokenizer())
    masked, plain = source.rollouts(None, 0, rank=0, world_size=1, device=None)
    assert len(masked.response_ids) == 4 and masked.response_mask == [1, 0, 1, 1]
    assert plain.response_mask is None


def test_reward_to_go_sums_the_rewards_from_each_token_on():
    import torch

    from fsdptrain.train.experience import reward_to_go

    # rewards [0.5, 0, 2] -> returns [2.5, 2, 2]
    assert torch.equal(reward_to_go(torch.tensor([0.5, 0.0, 2.0])), torch.tensor([2.5, 2.0, 2.0]))
