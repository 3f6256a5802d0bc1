"""The continuous engine (fsdptrain/generation/continuous.py): a row's tokens do not depend on its neighbours, their
number or its arrival; a kept cache continues a conversation as re-prefilling it does; a finished row costs no decode
forward; the engine's tokens are `generate`'s with the same row seeds."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.generate import generate_responses
from fsdptrain.generation.continuous import ContinuousEngine, decode_shape
from fsdptrain.generation.decoder import Request
from fsdptrain.generation.row_sampling import RowNoise
from tests.helpers.tiny_llama import tiny_llama

NEVER = 10**9  # an eos id no row samples: every row runs to its cap


@pytest.fixture(scope="module")
def setup():
    tokenizer = load_bundled_tokenizer()
    return tiny_llama(len(tokenizer), num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa"), tokenizer


PROMPTS = ["repeat 7 =", "copy 3 1 4 =", "repeat 2 =", "sort 9 8 7 6 5 ="]


def _ids(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


def _engine(model, tokenizer, eos=None, **kw):
    return ContinuousEngine(model, eos_id=tokenizer.eos_token_id if eos is None else eos,
                            pad_id=tokenizer.pad_token_id, temperature=0.7, **kw)


def _by_key(finished):
    return {f.key: (f.new_ids, f.logprobs) for f in finished}


def test_tokens_equal_generate_with_the_same_row_seeds(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    seeds = [11, 12, 13, 14]
    reference = generate_responses(model, tokenizer, ids, max_new_tokens=12, temperature=0.7, top_p=1.0,
                                   do_sample=False, generator_seed=0, device=torch.device("cpu"), row_seeds=seeds)
    out = _by_key(_engine(model, tokenizer).run(
        [Request(i, p, 12, seed=s) for i, (p, s) in enumerate(zip(ids, seeds))]))
    assert [out[i][0] for i in range(4)] == [response for _, response, _ in reference]


def test_a_rows_tokens_do_not_depend_on_its_neighbours_their_number_or_its_arrival(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    requests = lambda order: [Request(i, ids[i], 10, seed=100 + i) for i in order]  # noqa: E731
    alone = {i: _by_key(_engine(model, tokenizer, eos=NEVER).run(requests([i])))[i] for i in range(4)}
    together = _by_key(_engine(model, tokenizer, eos=NEVER).run(requests([0, 1, 2, 3])))
    reversed_ = _by_key(_engine(model, tokenizer, eos=NEVER).run(requests([3, 2, 1, 0])))
    late = _by_key(_engine(model, tokenizer, eos=NEVER, max_live_rows=2).run(requests([2, 0, 3, 1])))
    for run in (together, reversed_, late):
        for i in range(4):
            assert run[i][0] == alone[i][0]
            torch.testing.assert_close(torch.tensor(run[i][1]), torch.tensor(alone[i][1]), rtol=0, atol=1e-5)


def test_rows_enter_as_room_frees_within_the_live_row_bound(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    engine = _engine(model, tokenizer, eos=NEVER, max_live_rows=2)
    caps = [3, 8, 2, 4]
    finished = engine.run([Request(i, ids[i], caps[i], seed=i) for i in range(4)])
    assert engine.stats.max_live_rows == 2
    assert sorted(len(f.new_ids) for f in finished) == sorted(caps)
    assert [f.key for f in finished] == [0, 2, 3, 1]  # 0 leaves at decode 2, 2 enters; 2 leaves at 3, 3 enters; 3 leaves at 6, 1 at 7


def test_a_finished_row_costs_no_further_decode_forwards(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    engine = _engine(model, tokenizer, eos=NEVER)
    caps = [2, 9, 4, 1]
    engine.run([Request(i, ids[i], caps[i], seed=i) for i in range(4)])
    # a row's first token comes from its prefill, each later one from one decode forward's row
    assert engine.stats.num_row_steps == sum(c - 1 for c in caps)
    assert engine.stats.num_decode_forwards == max(caps) - 1


def test_decoding_onto_a_kept_cache_equals_re_prefilling_the_conversation(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS[:2])
    tool_message = tokenizer("result 42 ; answer", add_special_tokens=False)["input_ids"]
    first = _by_key_full(_engine(model, tokenizer, eos=NEVER).run(
        [Request(i, ids[i], 6, seed=i, keep=True) for i in range(2)]))
    for i in range(2):
        assert first[i].kept.length == len(ids[i]) + 5  # all but the last sampled token
    kept = _by_key(_engine(model, tokenizer, eos=NEVER).run(
        [Request(i, first[i].new_ids[-1:] + tool_message, 7, seed=50 + i, kept=first[i].kept) for i in range(2)]))
    fresh = _by_key(_engine(model, tokenizer, eos=NEVER).run(
        [Request(i, ids[i] + first[i].new_ids + tool_message, 7, seed=50 + i) for i in range(2)]))
    for i in range(2):
        assert kept[i][0] == fresh[i][0]
        torch.testing.assert_close(torch.tensor(kept[i][1]), torch.tensor(fresh[i][1]), rtol=0, atol=1e-5)


def _by_key_full(finished):
    return {f.key: f for f in finished}


def test_a_shared_prompt_is_prefilled_once_and_changes_no_token(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS[:2])
    requests = [Request((g, s), ids[g], 6, seed=10 * g + s) for g in range(2) for s in range(4)]
    engine = _engine(model, tokenizer, eos=NEVER)
    shared = _by_key(engine.run(requests))
    assert engine.stats.num_prefill_forwards == 2  # the two prompts' prefixes, then every row's last prompt token
    alone = {r.key: _by_key(_engine(model, tokenizer, eos=NEVER).run([r]))[r.key] for r in requests}
    assert {k: v[0] for k, v in shared.items()} == {k: v[0] for k, v in alone.items()}
    # the groups interleaved: a prompt's cache is copied to rows that are not next to each other
    interleaved = _by_key(_engine(model, tokenizer, eos=NEVER).run(
        [Request((g, s), ids[g], 6, seed=10 * g + s) for s in range(4) for g in range(2)]))
    assert {k: v[0] for k, v in interleaved.items()} == {k: v[0] for k, v in alone.items()}


def test_a_groups_prompt_is_held_once_and_gives_the_tokens_of_a_copy_per_row(setup):
    """The shared-prompt attention (one softmax over [the group's prompt ; the row's own keys]) against the engine
    holding a copy of the prompt in every row: the same ids, log-probs within 1e-5, with a row of a prompt no other
    row shares (no prefix) in the same batch; the cache holds each prompt once."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    requests = lambda: [Request((g, s), ids[g], 6, seed=10 * g + s)  # noqa: E731
                        for g, samples in ((0, 4), (1, 4), (2, 1)) for s in range(samples)]
    shared_engine = _engine(model, tokenizer, eos=NEVER, min_shared_prefix=1)  # these prompts are a few tokens
    shared = _by_key(shared_engine.run(requests()))
    copies_engine = _engine(model, tokenizer, eos=NEVER, min_shared_prefix=1)
    copies_engine.share_prefixes = False
    copies = _by_key(copies_engine.run(requests()))
    assert shared_engine.share_prefixes and shared.keys() == copies.keys()
    for key in shared:
        assert shared[key][0] == copies[key][0]
        torch.testing.assert_close(torch.tensor(shared[key][1]), torch.tensor(copies[key][1]), rtol=0, atol=1e-5)
    # at the last decode step: 9 rows x their own columns (prompt 2 whole; the others their last prompt token, then
    # the 5 tokens fed back) + the 2 shared prompts once each, as wide as the longer one (all but its last token)
    own = max(len(ids[2]), 1) + 5
    assert shared_engine.stats.max_cache_positions == 9 * own + 2 * (max(len(ids[0]), len(ids[1])) - 1)
    assert copies_engine.stats.max_cache_positions == 9 * (max(len(i) for i in ids[:3]) + 5)


def test_a_prefill_joins_the_decode_step_and_changes_no_token(setup):
    """A trajectory that re-enters while other rows decode (a tool message onto its kept cache) is prefilled in the
    live rows' decode forward (one packed forward): the ids of a separate prefill forward, log-probs within 1e-5, and
    a forward fewer per such entry, counted with a hook. Three rows of one prompt, caps 2, 5 and 9, each re-entering
    for 3 tokens: 1 prefill of the shared prompt and 1 of the rows' last prompt token, then rows 0 and 1 re-enter
    while row 2 decodes (fused: no forward of their own), row 2 alone (its own prefill); 8 + 2 decode forwards (row
    2's chain)."""
    model, tokenizer = setup
    prompt = _ids(tokenizer, PROMPTS[3:])[0]
    tool_ids = tokenizer("tool says 5", add_special_tokens=False)["input_ids"]

    def run(fuse: bool):
        def on_finish(finished):
            return [Request((1, f.key[1]), f.new_ids[-1:] + tool_ids, 3, seed=20 + f.key[1], kept=f.kept)
                    for f in finished if f.key[0] == 0]
        engine = _engine(model, tokenizer, eos=NEVER, min_shared_prefix=1, fuse_prefills=fuse)
        forwards = []
        hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
        try:
            out = _by_key(engine.run([Request((0, i), prompt, cap, seed=i, keep=True)
                                      for i, cap in enumerate((2, 5, 9))], on_finish))
        finally:
            hook.remove()
        s = engine.stats
        return out, (len(forwards), s.num_decode_forwards, s.num_prefill_forwards, s.num_prefills_in_decode)

    fused, fused_counts = run(True)
    separate, separate_counts = run(False)
    assert fused_counts == (13, 10, 3, 2) and separate_counts == (15, 10, 5, 0)
    assert sorted(fused) == sorted(separate) == [(t, i) for t in range(2) for i in range(3)]
    _assert_same_rows(fused, separate)


def test_new_rows_entering_late_are_prefilled_in_the_decode_step_and_keep_their_tokens(setup):
    """Rows of two groups entering as room frees (max_live_rows 2): each enters with its group's shared prompt in
    the live rows' decode forward, and every row's tokens are those it gets alone."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS[:2])
    def requests():
        return [Request((g, s), ids[g], 3 + s, seed=10 * g + s) for g in range(2) for s in range(3)]
    engine = _engine(model, tokenizer, eos=NEVER, min_shared_prefix=1, max_live_rows=2)
    late = _by_key(engine.run(requests()))
    assert engine.stats.num_prefills_in_decode > 0
    alone = {r.key: _by_key(_engine(model, tokenizer, eos=NEVER).run([r]))[r.key] for r in requests()}
    _assert_same_rows(late, alone)


def _assert_same_rows(got: dict, expected: dict) -> None:
    """The same keys and ids, log-probs within 1e-5."""
    assert got.keys() == expected.keys()
    for key in got:
        assert got[key][0] == expected[key][0]
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(expected[key][1]), rtol=0, atol=1e-5)


def test_tools_run_while_other_rows_decode(setup):
    """on_finish hands back a Future (a tool in a thread pool); the trajectory re-enters with the tool's tokens on
    its kept cache when the future is done, and its tokens are those of the same turns run one after the other."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    tool_ids = tokenizer("tool says 5", add_special_tokens=False)["input_ids"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        def follow(f):
            turn, i = f.key
            if turn == 1:
                return None
            return pool.submit(lambda: Request((1, i), f.new_ids[-1:] + tool_ids, 5, seed=7 + i, kept=f.kept))

        def on_finish(finished):
            return [future for future in map(follow, finished) if future is not None]
        engine = _engine(model, tokenizer, eos=NEVER)
        out = _by_key(engine.run([Request((0, i), ids[i], 3 + i, seed=i, keep=True) for i in range(4)], on_finish))
    for i in range(4):
        conversation = ids[i] + out[(0, i)][0] + tool_ids
        again = _by_key(_engine(model, tokenizer, eos=NEVER).run([Request(0, conversation, 5, seed=7 + i)]))[0]
        assert out[(1, i)][0] == again[0]


def test_noise_drawn_in_chunks_is_the_noise_of_one_draw_per_token():
    """RowNoise draws several tokens' uniforms at once; each token's noise must be what drawing its vocabulary's
    uniforms alone, token after token from the same generator, gives (RowSeededSampling's draw), bit for bit."""
    vocab, seed = 37, 123
    generator = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(torch.float64).tiny
    one_by_one = [(-torch.log(-torch.log(torch.rand(vocab, generator=generator, dtype=torch.float64)
                                          .clamp(tiny, 1.0 - 1e-16)))).float() for _ in range(20)]
    for steps in (1, 3, 16):
        noise = RowNoise(seed, vocab, steps, torch.device("cpu"))
        assert all(torch.equal(noise.next(), want) for want in one_by_one)
    for steps, total in ((3, 20), (16, 20), (20, 20), (16, 6)):  # the generator dropped once the chunks cover total
        noise = RowNoise(seed, vocab, steps, torch.device("cpu"), total=total)
        for k, want in enumerate(one_by_one[:total]):
            drawn = max(1, -(-k // steps)) * steps  # tokens drawn before token k's: whole chunks, the first at once
            assert (noise.generator is None) == (drawn >= total), (steps, total, k)
            assert torch.equal(noise.next(), want)
        assert noise.generator is None


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_live_rows=0"):
        ContinuousEngine(torch.nn.Linear(1, 1), eos_id=2, pad_id=0, max_live_rows=0)


def test_multi_turn_in_one_loop_equals_the_turn_by_turn_reference(tmp_path):
    """All trajectories and turns in one continuous loop, each turn decoded onto its kept cache, give the
    trajectories the turn loop builds re-prefilling each conversation through ``generate`` with the same row seeds
    (the tool-calling tiny model of tests/e2e/test_multi_turn.py calls tools from the start)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdptrain.data.conversation import ChatTurns
    from fsdptrain.rollout.tools import ToolCall, ToolCaller, load_tools
    from fsdptrain.rollout.turns import TurnCaps
    from tests.helpers.scripted_decoder import scripted_turns
    from tests.e2e.test_multi_turn import write_inputs

    write_inputs(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    tools = load_tools([str(tmp_path / "tools.py") + ":add"])
    chat = ChatTurns(tok, [t.schema for t in tools])
    caller = ToolCaller(tools, pool=None, timeout_s=None)
    call_tools = lambda reqs: caller.run([ToolCall(s, n, a) for s, n, a in reqs])  # noqa: E731
    prompts = [chat.prompt_ids([{"role": "user", "content": f"What is {a}+3?"}]) for a in range(3) for _ in range(3)]
    caps = TurnCaps(max_turns=3, max_new_tokens=60, max_tool_response_tokens=20)
    seed = lambda sample, turn: 1000 * sample + turn  # noqa: E731

    def generate(inputs, max_new_tokens, turn, samples):
        out = generate_responses(model, tok, inputs, max_new_tokens=max_new_tokens, temperature=0.7, top_p=1.0,
                                 do_sample=False, generator_seed=0, device=torch.device("cpu"),
                                 row_seeds=[seed(s, turn) for s in samples], synced_gpus=False)
        return [(ids, not truncated) for _, ids, truncated in out]

    reference = scripted_turns(chat, prompts, generate=generate, call_tools=call_tools, caps=caps)
    engine = ContinuousEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=0.7,
                              max_live_rows=4)
    got = scripted_turns(chat, prompts, generate=engine, seed=seed, call_tools=call_tools, caps=caps)
    assert max(t.num_turns for t in reference) >= 2 and sum(t.num_calls for t in reference) > 0
    for g, r in zip(got, reference, strict=True):
        assert (g.response_ids, g.response_mask, g.messages, g.truncation) == \
            (r.response_ids, r.response_mask, r.messages, r.truncation)
    assert engine.stats.num_row_steps == sum(sum(t.response_mask) for t in got) - sum(t.num_turns for t in got)


def test_the_decode_shape_buckets_rows_and_cache_columns_only_when_bucketed():
    assert decode_shape(5, 37, bucketed=False, block=64) == (5, 37)
    got = [decode_shape(n, w, bucketed=True, block=64) for n, w in [(1, 1), (2, 64), (3, 65), (5, 128), (8, 129),
                                                                      (9, 10), (17, 10), (64, 10)]]
    assert got == [(1, 64), (2, 64), (4, 128), (8, 128), (8, 192), (16, 64), (24, 64), (64, 64)]


def test_bucketed_decoding_gives_the_exact_shapes_tokens(setup):
    """The CUDA path on the CPU: padding rows and masked unused cache columns change no token."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    requests = lambda: [Request(i, ids[i], 3 + 2 * i, seed=40 + i) for i in range(4)]  # noqa: E731
    exact = _by_key(_engine(model, tokenizer, eos=NEVER, bucketed=False).run(requests()))
    engine = _engine(model, tokenizer, eos=NEVER, bucketed=True, max_live_rows=3)
    bucketed = _by_key(engine.run(requests()))
    assert engine.stats.max_live_rows == 4  # 3 live rows run as 4
    for i in range(4):
        assert bucketed[i][0] == exact[i][0]
        torch.testing.assert_close(torch.tensor(bucketed[i][1]), torch.tensor(exact[i][1]), rtol=0, atol=1e-5)


def test_a_prompt_shorter_than_the_shared_minimum_is_copied_per_row(setup):
    """A group's prompt below ``min_shared_prefix`` cached tokens is copied into each row (its columns cost less than
    the shared attention's fixed cost), at or above it held once: the cache positions say which, the ids are equal."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS[:2])
    requests = lambda: [Request((g, s), ids[g], 4, seed=10 * g + s) for g in range(2) for s in range(3)]  # noqa: E731
    longest = max(len(i) for i in ids) - 1  # the cached prefix: all but each prompt's last token
    runs = {}
    for minimum in (longest + 1, longest):
        engine = _engine(model, tokenizer, eos=NEVER, min_shared_prefix=minimum)
        runs[minimum] = (_by_key(engine.run(requests())), engine.stats.max_cache_positions)
    (copied, copied_positions), (held, held_positions) = runs[longest + 1], runs[longest]
    assert {k: v[0] for k, v in copied.items()} == {k: v[0] for k, v in held.items()}
    assert copied_positions == 6 * (longest + 1 + 3)  # every row: the whole prompt + the 3 tokens fed back
    assert held_positions < copied_positions
