"""A prompt that would run past the model's positions (its config's ``max_position_embeddings``; 1024 for the
config-built model) is a long prompt (docs/your-task.md): with ``data.long_prompts=error`` the run stops at start-up
with one line naming the row, the position it would reach and the limit, exit 2; the prompt alone past them and the
prompt with ``rollout.max_new_tokens`` after it alike. (Skipping and counting: tests/unit/test_prompts.py.)"""

from __future__ import annotations

import json

import pytest

SHORT = [{"prompt": "repeat 3 ="}] * 40


@pytest.mark.parametrize("long_prompt, max_new_tokens, line", [
    (" ".join(["7"] * 1100), 4, "has 1101 prompt tokens, which with rollout.max_new_tokens=4 reach position 1105"),
    ("1 + 2 + 3 =", 1019, "has 7 prompt tokens, which with rollout.max_new_tokens=1019 reach position 1026"),
], ids=["prompt-alone", "prompt-and-new-tokens"])
def test_a_prompt_past_the_models_positions_is_refused_in_one_line(cli, tmp_path, long_prompt, max_new_tokens, line):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*SHORT, {"prompt": long_prompt}]))
    proc = cli("train", "data=prompts", f"data.path={path}", "data.long_prompts=error", "trainer.steps=1",
               "reward.functions=[word_match]",
               f"rollout.max_new_tokens={max_new_tokens}", f"trainer.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [e for e in proc.stderr.splitlines() if e.strip()]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"row 40 (0-based, over all files) {line}, past the model's max_position_embeddings=1024" in errors[0]
