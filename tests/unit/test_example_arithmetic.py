"""examples/arithmetic: the committed files are what make_data.py writes, in the bundled tokenizer's vocabulary,
and a perfect completion scores 1 with the example's rewards."""

import subprocess
import sys
from pathlib import Path

from fsdptrain.data.prompts import load_prompts, prompt_token_ids
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.rewards import exact_match, word_match

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic"


def test_committed_files_are_what_make_data_writes(tmp_path):
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--out-dir", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name


def test_every_word_is_in_the_bundled_vocabulary_and_answers_score_one():
    tok = load_bundled_tokenizer()
    for name, num_rows in (("train.jsonl", 2000), ("eval.jsonl", 100)):
        rows = load_prompts(str(EXAMPLE / name), tokenizer=tok)
        assert len(rows) == num_rows
        assert all(tok.unk_token_id not in prompt_token_ids(tok, r) for r in rows)
        answers = [r.columns["answer"] for r in rows]
        assert all(tok.unk_token_id not in tok(a, add_special_tokens=False)["input_ids"] for a in answers)
        assert all(eval(r.text.rstrip("=")) == int(a) for r, a in zip(rows, answers))  # noqa: S307 (digits only)
        kwargs = dict(prompts=[r.text for r in rows], completions=answers, completion_ids=[[0]] * len(rows),
                      answer=answers)
        assert set(exact_match(**kwargs)) == set(word_match(**kwargs)) == {1.0}
