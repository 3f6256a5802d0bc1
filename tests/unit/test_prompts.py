"""Prompt datasets: every local format gives the JSONL's rows (CSV cells as the strings the file holds), each value as
the file wrote it; every bad input is one ConfigError naming where."""

import json

import pytest

from fsdptrain.config import ConfigError
from fsdptrain.data.epoch_order import EpochOrder
from fsdptrain.data.prompts import drop_long_prompts, hold_out_eval, load_prompts, prompt_token_ids
from fsdptrain.data.tokenizer import load_bundled_tokenizer

ROWS = [
    {"prompt": "3 + 4 =", "answer": 7, "level": "easy"},
    {"prompt": "1 + 1 =", "answer": 2, "level": "easy"},
    {"prompt": "9 - 2 =", "answer": 7, "level": "hard"},
]


@pytest.fixture(scope="module")
def tok():
    return load_bundled_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def as_tuples(rows):
    return [(r.index, r.text, r.columns, r.is_chat) for r in rows]


EXPECTED = [(0, "3 + 4 =", {"answer": 7, "level": "easy"}, False),
            (1, "1 + 1 =", {"answer": 2, "level": "easy"}, False),
            (2, "9 - 2 =", {"answer": 7, "level": "hard"}, False)]


def test_jsonl_rows_keep_every_other_column(tmp_path, tok):
    assert as_tuples(load_prompts(str(write_jsonl(tmp_path / "t.jsonl", ROWS)), tokenizer=tok)) == EXPECTED


def test_every_format_gives_the_jsonl_rows(tmp_path, tok):
    from datasets import Dataset

    table = Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.to_csv(str(tmp_path / "t.csv"), index=False)
    (tmp_path / "t.json").write_text(json.dumps(ROWS))
    table.save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    sources = [str(tmp_path / "t.parquet"), str(tmp_path / "t.csv"), str(tmp_path / "t.json"),
               str(tmp_path / "saved"), [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]]
    for source in sources:
        want = [(i, text, {**cols, "answer": str(cols["answer"])}, chat) for i, text, cols, chat in EXPECTED]
        assert as_tuples(load_prompts(source, tokenizer=tok)) == (want if str(source).endswith(".csv") else EXPECTED)


def test_each_value_reaches_the_reward_as_the_file_wrote_it(tmp_path, tok):
    from fsdptrain.rewards.builtin import exact_match

    rows = [{"prompt": f"q{i} =", "answer": a} for i, a in enumerate([7, 3, 1, 0.5])]
    got = [r.columns["answer"] for r in load_prompts(str(write_jsonl(tmp_path / "t.jsonl", rows)), tokenizer=tok)]
    assert [(v, type(v)) for v in got] == [(7, int), (3, int), (1, int), (0.5, float)]
    assert exact_match(["q"], ["7"], [[0]], answer=got[:1]) == [1.0]
    (tmp_path / "t.csv").write_text("prompt,answer\nq0 =,007\nq1 =,042\nq2 =,\n")
    got = [r.columns["answer"] for r in load_prompts(str(tmp_path / "t.csv"), tokenizer=tok)]
    assert got == ["007", "042", ""]
    (tmp_path / "mixed.jsonl").write_text('{"prompt": "a", "answer": 7}\n{"prompt": "b", "answer": "x"}\n'
                                          '{"prompt": "c"}\n')
    got = [r.columns for r in load_prompts(str(tmp_path / "mixed.jsonl"), tokenizer=tok)]
    assert got == [{"answer": 7}, {"answer": "x"}, {"answer": None}]


def test_chat_prompts_use_the_chat_template(tmp_path, tok):
    chat_tok = load_bundled_tokenizer()
    chat_tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                              "{% if add_generation_prompt %}assistant:{% endif %}")
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "2 + 2 ="}], "answer": "4"}])
    [row] = load_prompts(str(path), tokenizer=chat_tok)
    assert row.text == "system: be brief user: 2 + 2 = assistant:"
    assert row.is_chat and row.columns == {"answer": "4"}
    with pytest.raises(ConfigError, match=r"c\.jsonl: row 0 \(0-based\), column 'prompt': .*no chat template"):
        load_prompts(str(path), tokenizer=tok)


def test_custom_prompt_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 2 =", "answer": 3}])
    [row] = load_prompts(str(path), tokenizer=tok, prompt_key="question")
    assert (row.text, row.columns) == ("1 + 2 =", {"answer": 3})


@pytest.mark.parametrize("name, content, fragment", [
    ("empty.jsonl", b"", "empty.jsonl: empty file"),
    ("blank.jsonl", b"\n  \n", "blank.jsonl: empty file"),
    ("bin.jsonl", b'{"prompt": "a"}\n\x00\x01\x02', "bin.jsonl: line 2: binary data"),
    ("latin.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "latin.jsonl: line 2: not UTF-8 text (byte 0xe9)"),
    ("broken.jsonl", b'{"prompt": "a"}\n{"prompt": \n', "broken.jsonl: line 2: invalid JSON"),
    ("scalar.jsonl", b'{"prompt": "a"}\n[1, 2]\n', "scalar.jsonl: line 2: expected a JSON object, got list"),
    ("arr.json", b'[1, 2]', "arr.json: expected a JSON array of objects"),
    ("bin.parquet", b"\x89PNG....", "bin.parquet: not a Parquet file"),
    ("empty.csv", b"", "empty.csv: empty file"),
    ("nocol.jsonl", b'{"question": "a"}\n', "nocol.jsonl: no column 'prompt' (data.prompt_key); columns are ['question']"),
    ("clash.jsonl", b'{"prompt": "a", "completions": 1}\n', "column 'completions' clashes"),
    ("int.jsonl", b'{"prompt": 5}\n', "int.jsonl: row 0 (0-based), column 'prompt': expected a string or a chat"),
    ("null.jsonl", b'{"prompt": "a"}\n{"prompt": null}\n', "null.jsonl: row 1 (0-based), column 'prompt': expected"),
    ("es.jsonl", b'{"prompt": " "}\n', "es.jsonl: row 0 (0-based), column 'prompt': empty prompt"),
    ("badchat.jsonl", b'{"prompt": [{"role": "user"}]}\n', "badchat.jsonl: row 0 (0-based), column 'prompt'"),
    ("mixed.jsonl", b'{"prompt": "a"}\n{"prompt": 3}\n', "mixed.jsonl: row 1 (0-based), column 'prompt'"),
    ("ragged.csv", b'prompt,answer\na,1\nb,2,3\n', "ragged.csv: line 3: 3 cells for 2 columns"),
    ("twice.csv", b'prompt,answer,answer\na,1,2\n', "twice.csv: line 1: the header repeats the column 'answer'"),
])
def test_each_bad_file_is_one_line_naming_it(tmp_path, tok, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_prompts(str(path), tokenizer=tok)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("source, fragment", [
    ("openai/gsm8k", "no such file or folder (hub dataset names are not downloaded"),
    ("https://example.com/x.jsonl", "only local files are read"),
    ("hf://datasets/x/y", "only local files are read"),
    ("{dir}/t.txt", "unknown file type '.txt'"),
    ("{dir}", "not a folder written by Dataset.save_to_disk"),
    ([], "an empty list of files"),
])
def test_non_local_sources_are_refused(tmp_path, tok, source, fragment):
    (tmp_path / "t.txt").write_text("x")
    source = source.format(dir=tmp_path) if isinstance(source, str) else source
    with pytest.raises(ConfigError, match="data.path") as err:
        load_prompts(source, tokenizer=tok)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_dataset_dict_folder_names_its_splits(tmp_path, tok):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"a DatasetDict with splits \['train'\]; pass one split's folder"):
        load_prompts(str(tmp_path / "dd"), tokenizer=tok)


def test_long_prompts_are_skipped_and_counted_or_an_error(tmp_path, tok):
    rows = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "1 ="}, {"prompt": "1 + 2 + 3 ="}, {"prompt": "1 + 2 ="}])), tokenizer=tok)
    assert [len(prompt_token_ids(tok, r)) for r in rows] == [3, 7, 5]  # <bos> + words
    kept, dropped = drop_long_prompts(rows, tokenizer=tok, max_prompt_length=5)
    assert ([r.index for r in kept], dropped) == ([0, 2], 1)
    assert drop_long_prompts(rows, tokenizer=tok, max_prompt_length=None) == (rows, 0)
    with pytest.raises(ConfigError, match=r"row 1 \(0-based, over all files\) has 7 prompt tokens, more than "
                                          r"data.max_prompt_length=5"):
        drop_long_prompts(rows, tokenizer=tok, max_prompt_length=5, long_prompts="error")
    with pytest.raises(ConfigError, match="every prompt is longer than data.max_prompt_length=2"):
        drop_long_prompts(rows, tokenizer=tok, max_prompt_length=2)
    with pytest.raises(ConfigError, match="data.long_prompts='truncate' is not a valid choice"):
        drop_long_prompts(rows, tokenizer=tok, max_prompt_length=5, long_prompts="truncate")


def test_prompts_past_the_models_positions_are_long_prompts(tmp_path, tok):
    # lengths 3, 7, 5 (above); a model of 8 positions, 2 new tokens: 3 + 2 and 5 + 2 fit, 7 + 2 = 9 does not. The
    # prompt alone (7 <= 8) fits: the tokens sampled after it reach the position past the limit.
    rows = load_prompts(str(write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "1 ="}, {"prompt": "1 + 2 + 3 ="}, {"prompt": "1 + 2 ="}])), tokenizer=tok)
    positions = dict(tokenizer=tok, max_prompt_length=None, max_positions=8)
    kept, dropped = drop_long_prompts(rows, max_new_tokens=2, **positions)
    assert ([r.index for r in kept], dropped) == ([0, 2], 1)
    assert drop_long_prompts(rows, max_new_tokens=1, **positions) == (rows, 0)  # 7 + 1 = 8: the last position
    with pytest.raises(ConfigError, match=r"^data.path: row 1 \(0-based, over all files\) has 7 prompt tokens, which "
                                          r"with rollout.max_new_tokens=2 reach position 9, past the model's "
                                          r"max_position_embeddings=8 \(lower rollout.max_new_tokens, or raise "
                                          r"max_position_embeddings in the model's config where its RoPE scaling "
                                          r"makes longer positions valid\) \(or set data.long_prompts=skip\)$"):
        drop_long_prompts(rows, max_new_tokens=2, long_prompts="error", **positions)
    # the prompt alone past the positions: 7 > 6 (and 5 + 1 = 6 fits)
    kept, dropped = drop_long_prompts(rows, tokenizer=tok, max_prompt_length=None, max_positions=6, max_new_tokens=1)
    assert ([r.index for r in kept], dropped) == ([0, 2], 1)
    # both limits: max_prompt_length drops row 1, the positions row 2 (5 + 4 > 8)
    kept, dropped = drop_long_prompts(rows, tokenizer=tok, max_prompt_length=6, max_positions=8, max_new_tokens=4)
    assert ([r.index for r in kept], dropped) == ([0], 2)
    with pytest.raises(ConfigError, match=r"every prompt is longer than the model's max_position_embeddings=8 less "
                                          r"rollout.max_new_tokens=6 allow"):
        drop_long_prompts(rows, max_new_tokens=6, **positions)


def test_eval_hold_out_is_seeded_disjoint_and_complete():
    from fsdptrain.data.prompts import PromptRow

    rows = [PromptRow(i, str(i), {}) for i in range(50)]
    train, evals = hold_out_eval(rows, eval_size=10, seed=3)
    assert len(evals) == 10 and len(train) == 40
    assert sorted(r.index for r in train + evals) == list(range(50))
    assert [r.index for r in evals] == sorted(r.index for r in evals)
    again = hold_out_eval(rows, eval_size=10, seed=3)
    assert [r.index for r in again[1]] == [r.index for r in evals]
    assert [r.index for r in hold_out_eval(rows, eval_size=10, seed=4)[1]] != [r.index for r in evals]
    assert hold_out_eval(rows, eval_size=0, seed=3) == (rows, [])
    with pytest.raises(ConfigError, match=r"data.num_eval_prompts=50 must be in \[0, 50\)"):
        hold_out_eval(rows, eval_size=50, seed=3)


def test_epoch_order_visits_each_row_once_per_epoch_with_a_new_permutation():
    order = EpochOrder(7, seed=1)
    first, second = order.take(7), order.take(7)
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second
    assert first == order.permutation(0) and second == order.permutation(1)
    assert order.state_dict() == {"epoch": 1, "position": 7, "seed": 1, "num_rows": 7}


def test_resume_sees_the_prompts_an_uninterrupted_run_sees():
    uninterrupted = EpochOrder(10, seed=5)
    steps = [uninterrupted.take(4) for _ in range(9)]  # crosses epoch boundaries mid-step
    for stop in range(1, 9):
        run = EpochOrder(10, seed=5)
        for _ in range(stop):
            run.take(4)
        resumed = EpochOrder(10, seed=5)
        resumed.load_state_dict(dict(run.state_dict()))
        assert [resumed.take(4) for _ in range(9 - stop)] == steps[stop:]
    assert steps[2] == EpochOrder(10, seed=5).permutation(0)[8:] + EpochOrder(10, seed=5).permutation(1)[:2]


def test_order_refuses_a_state_from_another_dataset():
    state = EpochOrder(10, seed=5).state_dict()
    with pytest.raises(ConfigError, match="for 10 rows with seed 5, this run has 11 rows with seed 5"):
        EpochOrder(11, seed=5).load_state_dict(state)


@pytest.mark.parametrize("name, content", [
    ("state.json", "[]"), ("state.json", '{"_data_files": 3}'), ("state.json", '{"_data_files": [{}]}'),
    ("dataset_info.json", '{"features": 5}'), ("dataset_info.json", "[1]"),
])
def test_a_save_to_disk_folder_with_damaged_metadata_is_one_line(tmp_path, tok, name, content):
    from datasets import Dataset

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "saved" / name).write_text(content)
    with pytest.raises(ConfigError) as err:
        load_prompts(str(tmp_path / "saved"), tokenizer=tok)
    assert f"data.path={str(tmp_path / 'saved')!r}" in str(err.value) and "\n" not in str(err.value)
