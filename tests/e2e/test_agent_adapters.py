"""The environment standards' adapters (docs/agents.md "Environment standards"), end to end against the real packages:
the real CLI trains examples/openenv (an ``openenv-core`` environment through fsdptrain/rollout/openenv_agent.py) and
examples/verifiers (a ``verifiers`` taskset through fsdptrain/rollout/verifiers_agent.py) with a tiny model written
here; the rewards are the environment's, and the turns the trajectory recorded are what the environment saw (each
recorded episode replayed on a fresh environment gives the same observations, steps and reward)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.e2e.test_multi_turn import rows

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("openai")


def biased_model(likely: tuple[str, ...], extra_tokens: tuple[str, ...] = ()):
    """``(model, tokenizer)``: the tiny model of tests/e2e/test_multi_turn.py (character-level ChatML tokenizer,
    nearly context-free policy) whose likely tokens are EOS and ``likely``, each about as likely, every other token
    under 1%."""
    import torch

    from tests.helpers.chatml_tokenizer import chatml_tokenizer
    from tests.helpers.tiny_llama import tiny_llama

    tokenizer = chatml_tokenizer(extra_tokens=extra_tokens)
    model = tiny_llama(len(tokenizer), max_position_embeddings=1024)
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", *likely])
    with torch.no_grad():  # as in test_multi_turn.write_inputs: lm_head's first column acts as a bias
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[ids, 0] = 0.57
    return model, tokenizer


def write_model(folder: Path, likely: tuple[str, ...], extra_tokens: tuple[str, ...] = ()) -> None:
    model, tokenizer = biased_model(likely, extra_tokens)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


def adapter_args(folder: Path, example: str, steps: int) -> tuple[str, ...]:
    return ("model=local", f"model.path={folder / 'model'}", "algorithm=grpo", "data=prompts",
            f"data.path={ROOT / 'examples' / example / 'prompts.jsonl'}", "data.num_eval_prompts=2",
            "rollout.max_new_tokens=160", "rollout.max_turns=3", "rollout.prompts_per_step=2", "rollout.n=4",
            "trainer.eval_every=0", "logging.progress=false", "logging.samples_every=1", f"trainer.steps={steps}",
            f"rollout.agent={ROOT / 'examples' / example / 'agent.py'}:run", "trainer.run_name=run")


GUESSES = tuple(f'<tool_call>{{"name": "step", "arguments": {{"guess": {n}}}}}</tool_call>' for n in range(1, 9))


def test_openenv_the_guessing_game_trains_with_the_environments_rewards_and_sees_the_recorded_turns(tmp_path):
    pytest.importorskip("openenv")
    from tests.conftest import run_cli

    write_model(tmp_path, GUESSES, GUESSES)
    result = run_cli("train", *adapter_args(tmp_path, "openenv", 2), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = rows(tmp_path / "runs" / "run")
    assert [r["step"] for r in metrics] == [0, 1] and all(math.isfinite(r["actor/pg_loss"]) for r in metrics)
    assert any(r["actor/grad_norm"] > 0 for r in metrics)  # some group's episodes earned different rewards
    samples = [json.loads(s) for s in (tmp_path / "runs" / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and any(s["rewards"]["agent"] == 1.0 for s in samples)
    assert any(sum(m["role"] == "assistant" for m in s["turns"]) >= 2 for s in samples)  # an observation was read
    for s in samples:
        assert_replays(s)


def assert_replays(sample: dict) -> None:
    """The recorded episode, replayed on a fresh environment of examples/openenv/guess.py: the reset observation ends
    the prompt, the model's ``step`` calls, in order until the environment says done, give the recorded tool messages
    (those sent back to the model: the ones after the last request are not) and the per-step rewards the adapter
    returned, and the episode's reward is their sum."""
    sys.path.insert(0, str(ROOT / "examples" / "openenv"))
    try:
        from guess import GuessAction, GuessEnvironment
    finally:
        sys.path.remove(str(ROOT / "examples" / "openenv"))

    env = GuessEnvironment()
    first = json.dumps({"hint": env.reset(seed=sample["row"]).hint})
    assert sample["prompt"].endswith(f"user\n{first}<|im_end|>\n<|im_start|>assistant\n")
    observations, shown, done = [], 0, False
    for message in sample["turns"]:
        if message["role"] == "assistant":
            for call in message.get("tool_calls", []):
                if not done:
                    observations.append(env.step(GuessAction(**call["function"]["arguments"])))
                    done = observations[-1].done
        else:
            assert message["role"] == "tool" and json.loads(message["content"]) == {"hint": observations[shown].hint}
            shown += 1
    assert sample["agent"] == {"step_rewards": [o.reward for o in observations], "done": done}
    assert sample["rewards"]["agent"] == sum(o.reward for o in observations)


def test_verifiers_the_sums_train_with_the_tasks_rubric_and_the_turn_it_scored_is_the_recorded_one(tmp_path):
    pytest.importorskip("verifiers.v1")
    from tests.conftest import run_cli

    write_model(tmp_path, tuple("012345678"))
    result = run_cli("train", *adapter_args(tmp_path, "verifiers", 2), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = rows(tmp_path / "runs" / "run")
    assert [r["step"] for r in metrics] == [0, 1] and all(math.isfinite(r["actor/pg_loss"]) for r in metrics)
    assert any(r["actor/grad_norm"] > 0 for r in metrics)
    samples = [json.loads(s) for s in (tmp_path / "runs" / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and len({s["rewards"]["agent"] for s in samples}) > 1
    for s in samples:  # examples/verifiers/arith.py's rubric, worked out here on the recorded reply
        a, b = divmod(s["row"], 5)
        assert s["prompt"].endswith(f"system\nAnswer with the number only.<|im_end|>\n<|im_start|>user\nWhat is "
                                    f"{a}+{b}?<|im_end|>\n<|im_start|>assistant\n")
        [turn] = s["turns"]
        reply = turn["content"].strip()
        correct, short = float(reply == str(a + b)), float(len(reply) <= 4)
        assert s["agent"] == {"rewards": {"correct": correct, "short": short}, "metrics": {"length": len(reply)}}
        assert s["rewards"]["agent"] == pytest.approx(correct + 0.1 * short, abs=1e-12)
