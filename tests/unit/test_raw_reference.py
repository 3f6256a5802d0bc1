"""check-metrics' own cut of the raw generation output and its own rewards (fsdptrain/check/raw_reference.py):
values by hand, and the cut of what the recording hook saw against the product's, on a real ``generate`` and a real
continuous engine."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from fsdptrain.check.raw_reference import (
    DecodeRun,
    RawSequence,
    decoded_logprobs,
    decoded_sequences,
    raw_checks,
    recording_decoders,
    reference_cut,
    reference_prompt,
    reference_reward,
    reference_rewards,
)
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.decoder import Request, Sampling
from fsdptrain.generation.engines import make_decoder
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


def test_decoded_sequences_from_one_single_turn_call_and_none_otherwise():
    run = DecodeRun(keys=[0, 1, 2], prompts=[[7, 8], [9], [9]], follow_ups=False,
                    sampled={0: [5, EOS], 1: [4, 4, 4], 2: [6]})
    got = decoded_sequences([run], [0.5, None, 1.0], 3, eos_id=EOS, max_new_tokens=3)
    # request 2 stopped with neither EOS nor the cap: no response can be its cut (truncated None)
    assert got == [RawSequence([7, 8], [5, EOS], False, 0.5), RawSequence([9], [4, 4, 4], True, None),
                   RawSequence([9], [6], None, 1.0)]
    kw = dict(eos_id=EOS, max_new_tokens=3)
    assert decoded_sequences([run, run], None, 3, **kw) is None
    assert decoded_sequences([], None, 3, **kw) is None  # offline rollouts: nothing decoded
    assert decoded_sequences([run], None, 2, **kw) is None  # not the rollouts
    assert decoded_sequences([DecodeRun([0, 1, 2], run.prompts, True, run.sampled)], None, 3, **kw) is None  # turns
    assert decoded_sequences([DecodeRun([0, 1, 2], [[7], None, [9]], False, run.sampled)], None, 3, **kw) is None
    assert decoded_sequences([DecodeRun([0, 0, 2], run.prompts, False, run.sampled)], None, 3, **kw) is None


def test_decoded_logprobs_cover_each_response_from_one_single_turn_call_and_none_otherwise():
    run = DecodeRun(keys=[0, 1], prompts=[[7], [9]], follow_ups=False, sampled={0: [5, EOS, 0], 1: [4, 4]},
                    logprobs={0: [-0.5, -1.25, -3.0], 1: [-2.0, -0.125]})
    assert decoded_logprobs([run], [2, 2]) == [[-0.5, -1.25], [-2.0, -0.125]]  # the padding after EOS left out
    assert decoded_logprobs([run], [3, 3]) is None  # request 1 recorded 2 log-probs for 3 tokens
    assert decoded_logprobs([run, run], [2, 2]) is None and decoded_logprobs([], []) is None
    assert decoded_logprobs([DecodeRun([0, 1], run.prompts, True, run.sampled, run.logprobs)], [2, 2]) is None
    assert decoded_logprobs([DecodeRun([0, 1], run.prompts, False, run.sampled)], [2, 2]) is None  # none recorded


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


@pytest.mark.parametrize("engine", ["generate", "continuous"])
def test_the_recorded_decode_cuts_as_the_decoder_does(engine):
    """The recording hook sees every token each engine drew (generate: the row's padding after EOS too); the
    reference's own cut of them equals the decoder's ``Generated`` records, for rows that end on EOS and at the
    cap. No engine method is replaced."""
    tokenizer = load_bundled_tokenizer()
    model = _tiny_model(tokenizer)
    cfg = OmegaConf.create({"rollout": {"engine": engine, "max_live_rows": 5, "max_live_tokens": 1 << 20}})
    decoder = make_decoder(cfg, model, tokenizer, torch.device("cpu"))
    prompts = [tokenizer.encode(t) for t in ["repeat 7 =", "copy 3 1 4 =", "repeat 2 ="] * 8]
    requests = [Request(i, p, 8, seed=i, batch_seed=5) for i, p in enumerate(prompts)]
    methods = dict(vars(type(decoder)))
    with recording_decoders() as runs:
        out = {g.key: g for g in decoder.decode(requests, Sampling("train", 3.0, 1.0))}
    assert dict(vars(type(decoder))) == methods and runs[0].prompts == prompts
    got = decoded_sequences(runs, None, len(prompts), eos_id=EOS, max_new_tokens=8)
    assert [(s.prompt_ids, s.response_ids, s.truncated) for s in got] == \
        [(p, out[i].new_ids, out[i].truncated) for i, p in enumerate(prompts)]
    assert 0 < sum(not s.truncated for s in got) < len(got)  # both kinds of row
    # the generating forward's log-probs as the engine reported them: the records' own, bit for bit
    lengths = [len(out[i].new_ids) for i in range(len(prompts))]
    assert decoded_logprobs(runs, lengths) == [out[i].logprobs for i in range(len(prompts))]
