"""Agents that speak the OpenAI API (docs/agents.md), end to end: the real CLI trains the tiny tool-calling model of
tests/e2e/test_multi_turn.py while ``rollout.agent`` runs an agent written against the real ``openai`` client on the
real loopback endpoint; three tool turns train, resume exactly and match on two ranks; the trained ids are the ids
the engine sampled; an agent that edits its history trains with its segments recorded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_multi_turn import assert_resumed_and_two_ranks_match, rows, write_inputs

pytest.importorskip("openai")

TOOL_AGENT = '''
import json

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


async def run(client, row):
    """Up to three turns; every call answered (add adds, anything else is an error); reward: tool results."""
    messages = list(row["prompt"])
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            content = str(args["a"] + args["b"]) if call.function.name == "add" else '{"error": "unknown tool"}'
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content})
    return {"reward": float(sum(m["role"] == "tool" for m in messages)), "turns": len(messages)}
'''

RECORDING_AGENT = TOOL_AGENT.replace('''        message = reply.choices[0].message''', '''        sampled.append(reply.model_extra["fsdptrain"]["token_ids"])
        message = reply.choices[0].message''').replace('''    messages = list(row["prompt"])''', '''    messages = list(row["prompt"])
    sampled = []''').replace('''    return {"reward": float(sum(m["role"] == "tool" for m in messages)), "turns": len(messages)}''', '''    key = next(KEYS)
    with open("sampled.jsonl", "a") as f:
        f.write(json.dumps({"key": key, "turns": sampled}) + "\\n")
    return float(key)''').replace("import json\n", "import itertools\nimport json\n\nKEYS = itertools.count(1)\n", 1)

EDITING_AGENT = '''
async def run(client, row):
    """Two turns; the second drops the first answer and asks again (a new segment)."""
    first = await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=8)
    again = [*row["prompt"], {"role": "user", "content": "Again?"}]
    second = await client.chat.completions.create(model="policy", messages=again, max_tokens=8)
    return float(len(second.choices[0].message.content or ""))
'''

RECORD_IDS_REWARD = '''
import json


def record_ids(prompts, completions, completion_ids, agent_rewards, **kwargs):
    with open("trained.jsonl", "a") as f:
        for key, ids in zip(agent_rewards, completion_ids):
            f.write(json.dumps({"key": int(key), "ids": list(ids)}) + "\\n")
    return [0.0] * len(prompts)
'''


def agent_args(folder: Path, agent: str = "agent.py:run") -> tuple[str, ...]:
    return ("model=local", f"model.path={folder / 'model'}", "algorithm=grpo", "data=prompts",
            f"data.path={folder / 'prompts.jsonl'}", "data.num_eval_prompts=2", "rollout.max_new_tokens=160",
            "rollout.max_turns=3", "rollout.prompts_per_step=2", "rollout.n=4", "trainer.eval_every=0",
            "logging.progress=false", f"rollout.agent={agent}")


def test_an_agent_doing_three_tool_turns_trains_resumes_exactly_and_matches_on_two_ranks(tmp_path):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    (tmp_path / "agent.py").write_text(TOOL_AGENT)
    args = (*agent_args(tmp_path), "trainer.steps=3", "checkpoint.every=2", "logging.samples_every=1")
    one = run_cli("train", *args, "trainer.run_name=one", cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    reference = rows(tmp_path / "runs" / "one")
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert max(r["turns/max"] for r in reference) == 3  # an agent ran three tool turns
    assert all(r["agents/segments/mean"] == 1.0 for r in reference)  # each turn extended the previous one
    assert any(r["actor/grad_norm"] > 0 for r in reference) and all(math.isfinite(r["actor/pg_loss"])
                                                                     for r in reference)
    samples = [json.loads(s) for s in (tmp_path / "runs" / "one" / "samples.jsonl").read_text().splitlines()]
    assert any(sum(m["role"] == "assistant" for m in s["turns"]) >= 2 for s in samples)
    for s in samples:  # the agent's reward counts its tool messages; a request past the budget appended none
        tools = sum(m["role"] == "tool" for m in s["turns"])
        assert s["rewards"]["agent"] == tools if s["truncated"] is None else s["rewards"]["agent"] >= tools
    assert all(s["agent"]["turns"] >= 2 for s in samples)  # the rest of the dict the agent returned is recorded
    assert_resumed_and_two_ranks_match(tmp_path, args, reference)


def test_check_metrics_passes_on_an_agent_config_on_two_ranks(tmp_path):
    """check-metrics on an agent config: each rank's agents run against its own endpoint, and every layout
    comparison holds on the trajectories they made (the sampler's own responses, said in a note)."""
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    (tmp_path / "agent.py").write_text(TOOL_AGENT)
    out = tmp_path / "check.json"
    result = run_cli("check-metrics", "--nproc", "2", "--json", str(out), *agent_args(tmp_path), cwd=tmp_path,
                     timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-metrics: PASS" in result.stdout
    assert "the responses are the sampler's own" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["failures"] == []
    assert any(name.startswith("ranks=2") for name in report["layouts_run"])


def test_the_trained_ids_are_the_sampled_ids_never_the_sampled_text_tokenized_again(tmp_path):
    """Every turn's ids as the endpoint returned them (the engine's draws) sit, contiguous and in order, in the
    response the loss trains on; the tokenizer holds "ab" as one token, so the policy's separate "a" "b" would come
    back as another id if the server rendered sampled text again (the test checks such a pair was sampled)."""
    import torch

    from tests.conftest import run_cli
    from tests.e2e.test_multi_turn import ADD_CALL, INCREMENT_CALL
    from tests.helpers.chatml_tokenizer import chatml_tokenizer
    from tests.helpers.tiny_llama import tiny_llama

    write_inputs(tmp_path)
    tokenizer = chatml_tokenizer(extra_tokens=(ADD_CALL, INCREMENT_CALL, "ab"))
    model = tiny_llama(len(tokenizer), max_position_embeddings=1024)
    likely = tokenizer.convert_tokens_to_ids(["<|im_end|>", ADD_CALL, INCREMENT_CALL, "a", "b"])
    with torch.no_grad():  # as in test_multi_turn, plus "a" and "b" likely: "a" "b" is often sampled in a turn
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[likely, 0] = 0.57
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "agent.py").write_text(RECORDING_AGENT)
    (tmp_path / "record.py").write_text(RECORD_IDS_REWARD)
    result = run_cli("train", *agent_args(tmp_path), "reward.functions=[record.py:record_ids]", "trainer.steps=2",
                     "trainer.run_name=ids", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    sampled = {r["key"]: r["turns"] for r in map(json.loads, (tmp_path / "sampled.jsonl").read_text().splitlines())}
    trained = {r["key"]: r["ids"] for r in map(json.loads, (tmp_path / "trained.jsonl").read_text().splitlines())}
    assert sorted(sampled) == sorted(trained) == list(range(1, 17))
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    opening = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    pairs = 0
    for key, turns in sampled.items():
        turns = [t for t in turns if t]  # an empty answer: the trajectory's budget was spent
        ids, at = trained[key], 0
        assert ids[:len(turns[0])] == turns[0]
        for turn in turns:  # each later turn right after the template's opening (a turn of EOS alone also
            # matches the EOS closing a rendered tool message, which is not where it was sampled)
            found = next((i for i in range(at, len(ids) - len(turn) + 1) if ids[i:i + len(turn)] == turn
                          and (i == 0 or ids[i - len(opening):i] == opening)), None)
            assert found is not None, (key, turn, ids)
            at = found + len(turn)
            pairs += any(x == a and y == b for x, y in zip(turn, turn[1:]))
        assert at == len(ids)  # the last turn ends the response
    assert pairs > 0  # some turn sampled "a" then "b": tokenizing its text again gives "ab", another id


def test_an_agent_that_edits_its_history_trains_with_its_segments_recorded(tmp_path):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    (tmp_path / "agent.py").write_text(EDITING_AGENT)
    result = run_cli("train", *agent_args(tmp_path), "trainer.steps=1", "logging.samples_every=1",
                     "trainer.run_name=edits", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = rows(tmp_path / "runs" / "edits")[0]
    assert metrics["agents/segments/mean"] == 2.0 and metrics["agents/requests/mean"] == 2.0
    assert metrics["agents/untrained_tokens"] > 0 and math.isfinite(metrics["actor/pg_loss"])
    samples = [json.loads(s) for s in (tmp_path / "runs" / "edits" / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        first, second = s["segments"]
        assert first["turns"] == second["turns"] == 1 and 1 <= second["sampled_tokens"] <= 8
        assert s["prompt"].endswith("user\nAgain?<|im_end|>\n<|im_start|>assistant\n")  # the last one trains


RAISING_AGENT = '''
async def run(client, row):
    await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=2)
    raise ValueError("the agent broke")
'''

HANGING_AGENT = '''
import asyncio


async def run(client, row):
    await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=2)
    if row["index"] % 2:
        await asyncio.sleep(3600)
    return 1.0
'''

LATE_AGENT = '''
import openai

KEPT = []


async def run(client, row):
    """Calls a session of the previous step's rollout (its endpoint has stopped): reward 1 when refused."""
    await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=2)
    late = 0.0
    if KEPT and KEPT[0][0].port != client.base_url.port:  # another rollout phase's endpoint
        old = openai.AsyncOpenAI(base_url=KEPT[0][0], api_key=KEPT[0][1], max_retries=0)
        try:
            await old.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=2)
        except openai.APIConnectionError:
            late = 1.0
        await old.close()
    KEPT.append((client.base_url, client.api_key))
    return late
'''


@pytest.mark.parametrize("agent, want", [(RAISING_AGENT, "raised ValueError: the agent broke"),
                                         ("import sys\n\n\nasync def run(client, row):\n    sys.exit(3)\n",
                                          "raised SystemExit(3)"),
                                         ("import os\n\n\nasync def run(client, row):\n    os._exit(4)\n",
                                          "called os._exit(4)")])
def test_an_agent_that_raises_or_exits_stops_the_run_in_one_line(tmp_path, agent, want):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    (tmp_path / "agent.py").write_text(agent)
    result = run_cli("train", *agent_args(tmp_path), "trainer.steps=1", "trainer.run_name=bad", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: agent 'agent.py:run' on row ") and want in last, result.stderr


def test_an_agent_that_hangs_is_cut_off_at_the_timeout_and_the_run_trains(tmp_path):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    (tmp_path / "agent.py").write_text(HANGING_AGENT)
    result = run_cli("train", *agent_args(tmp_path), "trainer.steps=1", "reward.timeout_s=3",
                     "reward.timeout_score=-1", "trainer.run_name=hang", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = rows(tmp_path / "runs" / "hang")[0]
    hung = metrics["agents/num_timed_out"]
    assert 0 < hung < 8 and metrics["reward/agent/mean"] == pytest.approx(((8 - hung) - hung) / 8)


def test_a_call_after_its_rollout_ended_is_refused_and_the_run_goes_on(tmp_path):
    from tests.conftest import run_cli

    write_inputs(tmp_path)
    (tmp_path / "agent.py").write_text(LATE_AGENT)
    result = run_cli("train", *agent_args(tmp_path), "trainer.steps=2", "trainer.run_name=late", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["reward/agent/mean"] for r in rows(tmp_path / "runs" / "late")] == [0.0, 1.0]
