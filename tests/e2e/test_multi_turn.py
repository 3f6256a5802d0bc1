"""Multi-turn training end to end (docs/multi-turn.md): the real CLI trains a tiny model written here, whose
character-level ChatML tokenizer (tests/helpers/chatml_tokenizer.py) holds a whole tool call as one added token, so a
random policy calls tools from the first step; with a tool and with an environment class; resume after step 2 equals the
uninterrupted run; 1 and 2 ranks give the same metrics."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.conftest import metric_kinds, without_diagnostics
from tests.helpers.chatml_tokenizer import chatml_tokenizer

ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
INCREMENT_CALL = '<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>'

TOOLS_PY = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''

ENV_PY = '''
class Counter:
    """A counter the model increments; its reward is the count."""

    def reset(self, **columns):
        self.count = 0
        return " (start at 0)"

    def increment(self, by: int) -> int:
        """Increment the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)
'''

REWARD_PY = '''
def said_five(prompts, completions, completion_ids, answer, **kwargs):
    """1 when a tool message of the conversation holds the answer."""
    return [float(any(m["role"] == "tool" and m["content"] == answer for m in c)) for c in completions]


def saw_the_tool(prompts, completions, completion_ids, **kwargs):
    """1 when the prompt text holds the add tool's schema, as the policy saw it."""
    return [float('"name": "add"' in p and "<tools>" in p) for p in prompts]


def saw_environments(prompts, completions, completion_ids, environments, **kwargs):
    """The environment's count again, read through the environments= argument."""
    return [float(e.count) for e in environments]


def ran_a_tool(prompts, completions, completion_ids, **kwargs):
    """1 when the conversation holds a tool message (a single-turn completion, a string, holds none)."""
    return [float(not isinstance(c, str) and any(m["role"] == "tool" for m in c)) for c in completions]
'''


def write_inputs(folder: Path) -> Path:
    """The model folder, the prompts, the tools, the environment and the rewards, under ``folder``."""
    import torch

    from tests.helpers.tiny_llama import tiny_llama

    tokenizer = chatml_tokenizer(extra_tokens=(ADD_CALL, INCREMENT_CALL))
    model = tiny_llama(len(tokenizer), max_position_embeddings=1024)
    with torch.no_grad():
        # A large constant first embedding dimension makes every final hidden state point about the same way, so
        # lm_head's first column acts as a bias: the two call tokens and EOS get about 14% each, any other token
        # under 1%. The policy is nearly context-free but calls tools from the first step, over several turns.
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[[2, len(tokenizer) - 2, len(tokenizer) - 1], 0] = 0.57
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tools.py").write_text(TOOLS_PY)
    (folder / "env.py").write_text(ENV_PY)
    (folder / "rewards.py").write_text(REWARD_PY)
    return folder


def common(folder: Path) -> tuple[str, ...]:
    return ("model=local", f"model.path={folder / 'model'}", "algorithm=grpo", "data=prompts",
            f"data.path={folder / 'prompts.jsonl'}", "data.num_eval_prompts=2", "rollout.max_new_tokens=160",
            "rollout.max_turns=3", "rollout.prompts_per_step=2", "rollout.n=4", "trainer.eval_every=0",
            "logging.progress=false")


TOOL = ("rollout.tools=[tools.py:add]", "reward.functions=[rewards.py:said_five]")


def rows(run_dir: Path) -> list[dict]:
    kinds = metric_kinds(run_dir)
    return [without_diagnostics(json.loads(line), kinds) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_close_rows(got: list[dict], want: list[dict], *, tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key in w:
            assert abs(g[key] - w[key]) <= tol * max(1.0, abs(w[key])), (g["step"], key, g[key], w[key])


def assert_resumed_and_two_ranks_match(tmp_path: Path, args: tuple[str, ...], reference: list[dict]) -> None:
    """Run `one` (checkpointed at step 2, its rows `reference`) resumed from step 2 with `args`, then again on two
    ranks: the resumed run gives its last rows and the two-rank run all of them."""
    from tests.conftest import run_cli
    from tests.e2e.test_resume_export import copy_checkpoint

    copy_checkpoint(tmp_path / "runs" / "one", 2, tmp_path / "runs" / "resumed")
    resumed = run_cli("train", *args, "trainer.run_name=resumed", "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_close_rows(rows(tmp_path / "runs" / "resumed"), reference[2:], tol=1e-6)
    two = run_cli("train", "--nproc", "2", *args, "trainer.run_name=two", cwd=tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    assert_close_rows(rows(tmp_path / "runs" / "two"), reference, tol=1e-5)


@pytest.mark.slow
def test_tool_calls_train_resume_exactly_and_match_on_two_ranks(tmp_path):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    # the sampled evaluation runs the turns too (after steps 2 and 3), the same on 2 ranks as on 1
    evaluation = ("trainer.eval_every=2", "trainer.eval_n=2")
    args = (*[a for a in common(tmp_path) if not a.startswith("trainer.eval_every=")], *evaluation, *TOOL,
            "trainer.steps=3", "checkpoint.every=2")
    one = run_cli("train", *args, "trainer.run_name=one", cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    reference = rows(tmp_path / "runs" / "one")
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert [r["step"] for r in reference if "eval/mean@2" in r] == [1, 2]
    first = reference[0]
    # Tools were called and failed (increment is no tool here), the mask kept tool tokens out of the counts.
    assert first["tools/call_frequency"] > 0 and 0 < first["tools/failure_frequency"] < 1
    assert first["tools/response_tokens/mean"] > 0 and first["turns/max"] >= 2
    samples = [json.loads(s) for s in (tmp_path / "runs" / "one" / "samples.jsonl").read_text().splitlines()]
    assert any(m["role"] == "tool" for s in samples for m in s["turns"])
    # the first step's printout shows the calls (the first of a turn may be either tool, as the engine samples it)
    assert re.search(r"calls (add|increment)\(\{", one.stdout) and 'add({"a": 2, "b": 3})' in one.stdout
    assert_resumed_and_two_ranks_match(tmp_path, args, reference)


@pytest.mark.slow
def test_environment_class_trains_with_its_reward(tmp_path):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    result = run_cli("train", *common(tmp_path), "rollout.environment=env.py:Counter",
                     "reward.functions=[rewards.py:saw_environments]", "reward.weights=[0.5]", "trainer.steps=3",
                     "trainer.run_name=env", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = rows(tmp_path / "runs" / "env")
    assert len(metrics) == 3
    for row in metrics:  # get_reward and the environments= argument read the same instances
        assert row["reward/Counter/mean"] == row["reward/saw_environments/mean"]
        assert row["reward/mean"] == pytest.approx(1.5 * row["reward/Counter/mean"], abs=1e-12)
    assert metrics[0]["reward/Counter/mean"] > 0 and metrics[0]["tools/call_frequency"] > 0


def test_rewards_and_samples_get_the_prompt_the_policy_saw(tmp_path):
    """The prompt text reward functions receive (`prompts=`) and samples.jsonl shows is the prompt as rendered for
    the policy, the tools' schemas included (it was the prompt rendered without them)."""
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    result = run_cli("train", *common(tmp_path), "rollout.tools=[tools.py:add]", "rollout.max_new_tokens=40",
                     "rollout.max_turns=2", "rollout.n=2", "reward.functions=[rewards.py:saw_the_tool]",
                     "trainer.steps=1", "logging.samples_every=1", "trainer.run_name=seen", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert rows(tmp_path / "runs" / "seen")[0]["reward/saw_the_tool/mean"] == 1.0
    samples = [json.loads(line) for line in (tmp_path / "runs" / "seen" / "samples.jsonl").read_text().splitlines()]
    assert samples and all('"name": "add"' in s["prompt"] and s["prompt"].endswith("assistant\n") for s in samples)


def test_the_sampled_evaluation_of_a_multi_turn_run_runs_the_turns(tmp_path):
    """eval/mean@n of a multi-turn run is the mean reward of evaluation samples that called the tool (it was computed
    on single-turn samples without the tools: every sample's tool reward was 0)."""
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    result = run_cli("train", *common(tmp_path), "rollout.tools=[tools.py:add]", "rollout.max_new_tokens=40",
                     "rollout.max_turns=2", "rollout.n=2", "reward.functions=[rewards.py:ran_a_tool]",
                     "trainer.steps=1", "trainer.eval_every=1", "trainer.eval_n=4", "trainer.eval_k=[1,4]",
                     "trainer.run_name=evaluated", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    evaluated = [r for r in rows(tmp_path / "runs" / "evaluated") if "eval/mean@4" in r]
    assert evaluated and all(0 < r["eval/mean@4"] <= 1 for r in evaluated), evaluated
    assert all(r["eval/pass@4"] >= r["eval/pass@1"] > 0 for r in evaluated)


@pytest.mark.parametrize("engine", ["generate", "continuous"])
def test_a_multi_turn_run_with_a_reward_model_trains_on_its_scores_of_the_conversations(tmp_path, engine):
    """reward.models score multi-turn trajectories (they were refused): the reward model reads each sample's whole
    conversation (the prompt's message, the assistant turns, the tool messages) through its own chat template, and
    the logged scores are the ones transformers gives each conversation alone; with either rollout engine."""
    import torch

    from fsdptrain.model.reward_model import load_full_reward_model, load_reward_model_spec, reward_input_ids
    from tests.conftest import run_cli
    from tests.helpers.reward_model_folders import CHAT_TEMPLATE, char_tokenizer, save_reward_model

    write_inputs(tmp_path)
    reward_model = save_reward_model(tmp_path / "rm", tokenizer=char_tokenizer(CHAT_TEMPLATE), seed=3)
    result = run_cli("train", *common(tmp_path), "rollout.tools=[tools.py:add]", "rollout.max_new_tokens=100",
                     "rollout.max_turns=2", "rollout.n=2", "reward.functions=[rewards.py:ran_a_tool]",
                     f"reward.models=[{reward_model}]", "trainer.steps=2", "logging.samples_every=1",
                     f"rollout.engine={engine}", "trainer.run_name=scored", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "runs" / "scored"
    metrics = rows(run)
    assert [r["step"] for r in metrics] == [0, 1]
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    spec = load_reward_model_spec(reward_model)
    model = load_full_reward_model(spec)
    seen = []
    for row in metrics:
        mine = [s for s in samples if s["step"] == row["step"]]
        assert len(mine) == 4  # every sample of the step (2 prompts x 2)
        conversations = [prompts[s["row"]] + [m for m in s["turns"] if m.get("appended", True)] for s in mine]
        seen += conversations
        with torch.no_grad():
            alone = [float(model(input_ids=torch.tensor([reward_input_ids(spec, "", "", messages=c)])).logits[0, 0])
                     for c in conversations]
        assert row["reward_model/0/raw/mean"] == pytest.approx(sum(alone) / 4, abs=1e-5)
        # the total each sample trains on is the tool reward plus the reward model's (scaled) score
        assert [s["total"] for s in mine] == pytest.approx(
            [s["rewards"]["ran_a_tool"] + s["rewards"]["reward_model/0"] for s in mine], abs=1e-9)
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0 and row["tools/call_frequency"] > 0
    assert any(m["role"] == "tool" for c in seen for m in c)  # the reward model read tool results


def test_a_tokenizer_without_a_tools_template_is_one_line_and_exit_2(cli, tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    result = cli("train", "rollout.tools=[tools.py:add]", "trainer.run_name=bad")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "chat template" in result.stderr, result.stderr
    assert not (tmp_path / "runs" / "bad").exists()
