"""check-metrics' own cut of the raw generation output and its own rewards (fsdptrain/check/raw_reference.py):
values by hand, and the cut against the product's on a real ``generate`` and a real continuous engine."""

from __future__ import annotations

import math

import torch
from transformers import LlamaForCausalLM

from fsdptrain.check.raw_reference import (
    EngineRun,
    RawCall,
    RawSequence,
    engine_sequences,
    raw_checks,
    raw_sequences,
    recording_engine,
    recording_generate,
    reference_cut,
    reference_prompt,
    reference_reward,
    reference_rewards,
)
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.generate import generate_responses
from fsdptrain.generation import continuous as engine_module
from fsdptrain.rollout.continuous import generate_continuous
from fsdptrain.generation.continuous import ContinuousEngine
from tests.helpers.tiny_llama import tiny_llama

EOS = 2


def test_the_cut_keeps_the_first_eos_and_drops_what_follows():
    assert reference_cut([5, 6, EOS, 0, 0], eos_id=EOS, max_new_tokens=5) == ([5, 6, EOS], False)
    assert reference_cut([EOS, EOS, 7], eos_id=EOS, max_new_tokens=3) == ([EOS], False)
    assert reference_cut([5, 0, 7], eos_id=EOS, max_new_tokens=3) == ([5, 0, 7], True)  # a sampled pad id is kept
    assert reference_cut([5, 6, 7, 8], eos_id=EOS, max_new_tokens=3) == ([5, 6, 7], True)


def test_the_prompt_is_what_the_mask_keeps():
    assert reference_prompt([0, 0, 7, 8], [0, 0, 1, 1]) == [7, 8]


def test_the_reward_is_the_weighted_sum_of_the_values_that_are_numbers():
    assert reference_reward([0.5, None, 2.0], [2.0, 3.0, -1.0]) == 1.0 - 2.0
    assert reference_reward([None, None], [1.0, 1.0]) == 0.0
    raw = {"a": [1.0, None], "b": [0.25, 0.5]}
    assert reference_rewards(raw, ["a", "b"], [2.0, 4.0], [0.125, -1.0], 2) == [2.0 + 1.0 + 0.125, 2.0 - 1.0]


def test_sequences_from_one_call_and_none_from_several():
    call = RawCall(input_ids=[[0, 7, 8], [9, 9, 9]], attention_mask=[[0, 1, 1], [1, 1, 1]],
                   sequences=[[0, 7, 8, 5, EOS, 0], [9, 9, 9, 4, 4, 4]])
    got = raw_sequences([call], [0.5, None], 2, eos_id=EOS, max_new_tokens=3)
    assert got == [RawSequence([7, 8], [5, EOS], False, 0.5), RawSequence([9, 9, 9], [4, 4, 4], True, None)]
    assert raw_sequences([call, call], None, 2, eos_id=EOS, max_new_tokens=3) is None
    assert raw_sequences([], None, 2, eos_id=EOS, max_new_tokens=3) is None
    assert raw_sequences([None], None, 2, eos_id=EOS, max_new_tokens=3) is None


def test_engine_sequences_from_one_single_turn_run_and_none_otherwise():
    run = EngineRun(keys=[0, 1, 2], prompts=[[7, 8], [9], [9]], follow_ups=False,
                    sampled={0: [5, EOS], 1: [4, 4, 4], 2: [6]})
    got = engine_sequences([run], [0.5, None, 1.0], 3, eos_id=EOS, max_new_tokens=3)
    # request 2 stopped with neither EOS nor the cap: no response can be its cut (truncated None)
    assert got == [RawSequence([7, 8], [5, EOS], False, 0.5), RawSequence([9], [4, 4, 4], True, None),
                   RawSequence([9], [6], None, 1.0)]
    kw = dict(eos_id=EOS, max_new_tokens=3)
    assert engine_sequences([run, run], None, 3, **kw) is None
    assert engine_sequences([], None, 3, **kw) is None  # another engine
    assert engine_sequences([run], None, 2, **kw) is None  # not the rollouts
    assert engine_sequences([EngineRun([0, 1, 2], run.prompts, True, run.sampled)], None, 3, **kw) is None  # turns
    assert engine_sequences([EngineRun([0, 1, 2], [[7], None, [9]], False, run.sampled)], None, 3, **kw) is None
    assert engine_sequences([EngineRun([0, 0, 2], run.prompts, False, run.sampled)], None, 3, **kw) is None


def test_checks_fail_on_a_different_cut_and_a_different_reward():
    want = [RawSequence([7], [5, EOS], False, 0.5), RawSequence([8], [4, 4], True, 1.0)]
    assert all(c.passed for c in raw_checks(want, want, atol=1e-6, rtol=1e-5, responses_recut=True))
    cut_short = [RawSequence([7], [5], False, 0.5), want[1]]
    responses, rewards = raw_checks(cut_short, want, atol=1e-6, rtol=1e-5, responses_recut=True)
    assert not responses.passed and responses.value == 1.0 and rewards.passed
    clipped = [want[0], RawSequence([8], [4, 4], True, 0.25)]
    responses, rewards = raw_checks(clipped, want, atol=1e-6, rtol=1e-5, responses_recut=True)
    assert responses.passed and not rewards.passed and rewards.value == 0.75
    nan = [want[0], RawSequence([8], [4, 4], True, math.nan)]
    assert not raw_checks(nan, want, atol=1e-6, rtol=1e-5, responses_recut=False)[-1].passed
    assert len(raw_checks(cut_short, want, atol=1e-6, rtol=1e-5, responses_recut=False)) == 1  # rewards only


def _tiny_model(tokenizer) -> LlamaForCausalLM:
    return tiny_llama(len(tokenizer), eos_token_id=EOS, attn_implementation="sdpa")


def test_the_recorded_generate_cuts_as_the_sampler_does():
    tokenizer = load_bundled_tokenizer()
    model = _tiny_model(tokenizer)
    texts = ["repeat 7 =", "copy 3 1 4 =", "repeat 2 ="] * 8
    with recording_generate(model) as calls:
        out = generate_responses(model, tokenizer, texts, max_new_tokens=8, temperature=3.0, top_p=1.0,
                                 do_sample=True, generator_seed=5, device=torch.device("cpu"))
    assert "generate" not in vars(model)  # the model's own method again
    got = raw_sequences(calls, None, len(texts), eos_id=EOS, max_new_tokens=8)
    assert [(s.prompt_ids, s.response_ids, s.truncated) for s in got] == [tuple(o) for o in out]
    assert 0 < sum(not s.truncated for s in got) < len(got)  # both kinds of row


def test_the_recorded_engine_cuts_as_the_continuous_sampler_does():
    tokenizer = load_bundled_tokenizer()
    model = _tiny_model(tokenizer)
    prompts = [tokenizer.encode(t) for t in ["repeat 7 =", "copy 3 1 4 =", "repeat 2 ="] * 8]
    engine = ContinuousEngine(model, eos_id=EOS, pad_id=0, temperature=3.0, max_live_rows=5)  # rows wait and enter
    methods = (ContinuousEngine.run, ContinuousEngine._sample, engine_module.sample_rows)
    with recording_engine() as runs:
        out = generate_continuous(engine, prompts, list(range(len(prompts))), max_new_tokens=8)
    assert (ContinuousEngine.run, ContinuousEngine._sample, engine_module.sample_rows) == methods  # restored
    got = engine_sequences(runs, None, len(prompts), eos_id=EOS, max_new_tokens=8)
    assert [(s.prompt_ids, s.response_ids, s.truncated) for s in got] == [tuple(o[:3]) for o in out]
    assert 0 < sum(not s.truncated for s in got) < len(got)  # both kinds of row


def test_the_policy_mask_is_the_reference_rule_not_the_rollouts():
    from fsdptrain.check.batch import reference_policy, tool_segments
    from fsdptrain.data.rollout_record import Rollout

    eos_masked = Rollout(prompt_ids=[7], response_ids=[5, 6, 4, 3, EOS], reward=0.0, group=1,
                         response_mask=[1, 1, 1, 1, 0])
    assert reference_policy([eos_masked], [5], fixture=False, single_turn=True) == [[True] * 5]  # every token
    assert reference_policy([eos_masked], [5], fixture=False, single_turn=False) == [[True] * 4 + [False]]  # shared
    # the fixture: group 1, first sample -> variant 1 (two tool segments inside), over the length given
    assert reference_policy([eos_masked], [8], fixture=True, single_turn=True) == [
        [bool(m) for m in tool_segments(8, 1)]]
    assert tool_segments(8, 1) == [1, 1, 0, 1, 0, 1, 1, 1]
