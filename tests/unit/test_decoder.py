"""The generation room's seam (fsdptrain/generation/decoder.py): the temperature rule, the batching engine's rounds,
the recording hook, the engine chosen from the config, and the generate decoder against transformers' generate
called directly (fsdptrain/generation/generate.py)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from omegaconf import OmegaConf

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.continuous import ContinuousDecoder
from fsdptrain.generation.decoder import (
    Generated,
    Request,
    Sampling,
    active_recorder,
    decode_in_batches,
    generated_in_context,
    recording,
    sampling_for,
)
from fsdptrain.generation.engines import make_decoder
from fsdptrain.generation.generate import GenerateDecoder, generate_responses
from fsdptrain.generation.seeds import batch_seed, sampling_seed
from tests.helpers.tiny_llama import tiny_llama

CFG = OmegaConf.create({"rollout": {"temperature": 0.7, "top_p": 0.9, "engine": "generate", "max_live_rows": 4,
                                    "max_live_tokens": 1 << 20, "gather_weights": "auto",
                                    "gather_weights_max_share": 0.5},
                        "trainer": {"eval_temperature": 0.3}, "parallel": {"param_dtype": "float32",
                                                                          "reshard_after_forward": True}})


def test_one_temperature_rule_for_every_mode():
    assert sampling_for(CFG, "train", repeat=4) == Sampling("train", 0.7, 0.9, 4)
    assert sampling_for(CFG, "eval") == Sampling("eval", 0.3, 1.0, 1)
    assert sampling_for(CFG, "greedy") == Sampling("greedy", 1.0, 1.0, 1)


def test_the_generate_batch_seed_is_the_rank_seed_offset_per_round():
    assert batch_seed(3, 5, 1, 0) == sampling_seed(3, 5, 1) == (3 * 1_000_003 + 5 * 1_009 + 1) % 2**31
    assert batch_seed(3, 5, 1, 2) == (sampling_seed(3, 5, 1) + 2 * 104_729) % 2**31


def test_rounds_run_batch_by_batch_and_follow_ups_join_the_next_round():
    """Two batches: each one's requests decode together, round after round, the first batch's last round before
    the second batch starts; follow-ups (some as futures) are the next round; kept contexts reach on_finish only."""
    calls = []

    def generate_batch(waiting):
        calls.append([r.key for r in waiting])
        return [Generated(r.key, [len(calls)], [], True, kept=["ctx", r.key]) for r in waiting]

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def on_finish(generated):
        assert all(g.kept == ["ctx", g.key] for g in generated)
        follow = [Request((g.key, "again"), [1], 3, batch=g.key[0]) for g in generated if g.key[1] != "again"]
        return [pool.submit(lambda f=follow[:1]: f), *follow[1:]] if follow else []

    requests = [Request(("a", 0), [5], 3, batch="a"), Request(("b", 0), [6], 3, batch="b"),
                Request(("a", 1), [7], 3, batch="a")]
    done = decode_in_batches(requests, on_finish, generate_batch)
    pool.shutdown()
    assert calls == [[("a", 0), ("a", 1)], [(("a", 0), "again"), (("a", 1), "again")], [("b", 0)],
                     [(("b", 0), "again")]]
    assert [g.key for g in done] == [key for round_ in calls for key in round_]
    assert all(g.kept is None for g in done)


def test_a_follow_up_outside_its_batch_is_refused():
    def generate_batch(waiting):
        return [Generated(r.key, [1], [], True) for r in waiting]

    with pytest.raises(ValueError, match="stay in its request's batch"):
        decode_in_batches([Request(0, [5], 2, batch="a")], lambda g: [Request(1, [1], 2, batch="b")],
                          generate_batch)


def test_the_recorder_is_the_innermost_blocks_and_none_outside():
    outer, inner = object(), object()
    assert active_recorder() is None
    with recording(outer):
        with recording(inner):
            assert active_recorder() is inner
        assert active_recorder() is outer
    assert active_recorder() is None


def test_the_engine_is_chosen_once_from_the_config():
    model, tokenizer = torch.nn.Linear(1, 1), load_bundled_tokenizer()
    assert isinstance(make_decoder(CFG, model, tokenizer, torch.device("cpu")), GenerateDecoder)
    continuous = OmegaConf.merge(CFG, {"rollout": {"engine": "continuous"}})
    assert isinstance(make_decoder(continuous, model, tokenizer, torch.device("cpu")), ContinuousDecoder)


@pytest.mark.parametrize("mode", ["train", "eval", "greedy"])
def test_the_generate_decoder_draws_what_generate_draws(mode):
    """The same tokens, truncation and log-probs as ``generate_responses`` called as the single-turn sampler once
    called it (one batch, the batch seed; row seeds in the sampled evaluation); a row's cap below the call's cuts
    it (then truncated)."""
    tokenizer = load_bundled_tokenizer()
    model = tiny_llama(len(tokenizer), attn_implementation="sdpa")
    prompts = [tokenizer.encode(t) for t in ["repeat 7 =", "copy 3 1 4 =", "repeat 2 ="] * 2]
    sampling = Sampling(mode, 3.0 if mode != "greedy" else 1.0, 1.0, 2)
    decoder = GenerateDecoder(CFG, model, tokenizer, torch.device("cpu"))
    requests = [Request(i, p, 8 if i else 3, seed=100 + i, batch_seed=17) for i, p in enumerate(prompts)]
    got = {g.key: g for g in decoder.decode(requests, sampling)}
    want = generate_responses(model, tokenizer, prompts, max_new_tokens=8, temperature=sampling.temperature,
                              top_p=1.0, do_sample=mode == "train", generator_seed=17 if mode == "train" else 0,
                              device=torch.device("cpu"),
                              row_seeds=[100 + i for i in range(6)] if mode == "eval" else None,
                              share_prompt_prefill=mode != "eval", record_logprobs=mode == "train")
    for i, out in enumerate(want):
        ids, truncated = out[1], out[2]
        if i == 0 and len(ids) > 3:
            ids, truncated = ids[:3], True
        assert (got[i].new_ids, got[i].truncated) == (ids, truncated)
        if mode == "train":
            assert got[i].logprobs == out[3][:len(ids)]
    assert got[0].truncated and len(got[0].new_ids) == 3
    if mode == "train":  # the tiny random model ends rows on EOS only when sampled hot
        assert any(not g.truncated for g in got.values())


def test_a_row_past_its_own_cap_is_cut_and_not_ended():
    request = Request("k", [9], 2, keep=True)
    cut = generated_in_context(request, [1, 2, 9], [5, 6, 7], True, [-0.5, -0.25, -0.125])
    assert (cut.new_ids, cut.logprobs, cut.ended, cut.kept) == ([5, 6], [-0.5, -0.25], False, [1, 2, 9, 5])
    whole = generated_in_context(Request("k", [9], 3), [9], [5, 2], True)
    assert (whole.new_ids, whole.logprobs, whole.ended, whole.kept) == ([5, 2], [], True, None)
