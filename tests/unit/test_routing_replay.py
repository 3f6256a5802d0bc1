"""Routing replay (docs/moe.md, "Routing replay"): the experts each MoE layer chose while the engines drew tokens are
recorded per request (fsdptrain/generation/routes.py), laid out on a pack's model row (fsdptrain/data/packing.py,
fsdptrain/data/shared_prompts.py) and replayed in the training forward (fsdptrain/model/moe.py, OWN_ROUTE).

The reference for a recorded route is one plain forward of the whole sequence (prompt + every sampled token but the
last) under ``routing(record=True)``: on a model whose routers have no near-ties, the experts chosen there are the
ones the engines chose, whatever the batch, cache, padding or shared prompt; so the record must equal it exactly.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from fsdptrain.data.packing import pack_sequences
from fsdptrain.data.shared_prompts import pack_shared_prompts
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.continuous import ContinuousEngine
from fsdptrain.generation.decoder import Request, Sampling
from fsdptrain.generation.generate import GenerateDecoder
from fsdptrain.model.attention_switch import packed_model_inputs, set_attention
from fsdptrain.model.moe import OWN_ROUTE, routing
from tests.helpers.tiny_moe import tiny_moe

NEVER = 10**9  # an eos id no row samples
PROMPTS = ["repeat 7 =", "copy 3 1 4 =", "repeat 2 =", "sort 9 8 7 6 5 ="]


@pytest.fixture(scope="module")
def setup():
    return tiny_moe(attn_implementation="sdpa"), load_bundled_tokenizer()


def _ids(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


def _reference(model, ids: list[int]) -> torch.Tensor:
    """``[L, n, k]`` routes of one plain forward over ``ids``, each token's experts sorted."""
    with torch.no_grad(), routing(model, record=True) as routes:
        model(input_ids=torch.tensor([ids]))
    return routes.stacked_indices().sort(dim=-1).values


def _assert_routes(model, generated, sequences: dict) -> None:
    for g in generated:
        ids = sequences[g.key] + g.new_ids[:-1]
        assert g.routes is not None and g.routes.shape == (2, len(ids), 2) and g.routes.dtype == torch.uint8
        assert torch.equal(g.routes.long().sort(dim=-1).values, _reference(model, ids)), g.key


def _engine(model, tokenizer, **kw):
    return ContinuousEngine(model, eos_id=NEVER, pad_id=tokenizer.pad_token_id, temperature=0.7, record_routes=True,
                            **kw)


def test_the_continuous_engine_records_each_fed_tokens_experts(setup):
    """Rows entering as room frees, each prefilled on its own or within the live rows' decode step, with their
    prompts held once per group (the prefix's routes from the prefix's forward) or per row."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    for kw in ({}, {"max_live_rows": 2}, {"min_shared_prefix": 1, "max_live_rows": 3}):
        requests = [Request((g, s), ids[g], 3 + s, seed=10 * g + s) for g in range(4) for s in range(2)]
        engine = _engine(model, tokenizer, **kw)
        generated = engine.run(requests)
        _assert_routes(model, generated, {r.key: r.new_ids for r in requests})
    assert engine.stats.num_prefills_in_decode > 0  # the fused path was taken


def test_a_turn_onto_its_kept_cache_records_from_its_new_ids_on(setup):
    """Multi-turn: the follow-up's record starts at its new ids (the last sampled token, then the tool's), so the
    turns' records concatenate to the whole trajectory but its last token."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS[:3])
    tool = tokenizer("tool says 5", add_special_tokens=False)["input_ids"]
    first: dict = {}

    def on_finish(finished):
        follow = []
        for f in finished:
            if f.key[0] == 0:
                first[f.key[1]] = f
                follow.append(Request((1, f.key[1]), f.new_ids[-1:] + tool, 4, seed=20 + f.key[1], kept=f.kept))
        return follow

    engine = _engine(model, tokenizer, min_shared_prefix=1)
    done = {g.key: g for g in engine.run(
        [Request((0, i), ids[i % 2], cap, seed=i, keep=True) for i, cap in enumerate((2, 5, 3))], on_finish)}
    for i in range(3):
        one, two = first[i], done[(1, i)]
        whole = ids[i % 2] + one.new_ids + tool + two.new_ids[:-1]
        recorded = torch.cat([one.routes, two.routes], dim=1).long().sort(dim=-1).values
        assert torch.equal(recorded, _reference(model, whole))


def test_the_generate_engine_records_the_same(setup):
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS)
    cfg = OmegaConf.create({"rollout": {"placement": "colocated"}})
    decoder = GenerateDecoder(cfg, model, tokenizer, torch.device("cpu"))
    requests = [Request(i, ids[i % 4], 5, batch=0, batch_seed=3) for i in range(6)]
    generated = decoder.decode(requests, Sampling("train", 1.0, 1.0, repeat=1))
    _assert_routes(model, generated, {r.key: r.new_ids for r in requests})
    assert all(g.routes is None for g in decoder.decode(requests[:2], Sampling("greedy", 1.0, 1.0)))


def _row_routes(model, packed_inputs: dict, replay=None) -> torch.Tensor:
    with torch.no_grad(), routing(model, record=True, replay=replay) as routes:
        out = model(**packed_inputs)
    return routes.stacked_indices(), out.logits[0]


def test_a_pack_lays_the_routes_on_its_model_row_and_the_replay_follows_them(setup):
    """Per sequence a record of all but its last token; the pack holds them at their positions, OWN_ROUTE at each
    sequence's last token and in the tail. Replaying a pack whose routes were rewritten (every token sent to experts
    0 and 1, say) routes exactly those; replaying the true routes changes no log-prob; the rows left OWN_ROUTE take
    the router's own choice. Shared prompts: the model row holds the prompt's routes once (the first sequence's)."""
    model, tokenizer = setup
    ids = _ids(tokenizer, PROMPTS[:2])
    responses = [[5, 6, 7], [8, 9], [10]]
    prompts = [ids[0], ids[0], ids[1]]
    routes = [_reference(model, p + r[:-1]).to(torch.uint8) for p, r in zip(prompts, responses)]
    packed = pack_sequences(prompts, responses, routes=routes, pad_to=20)
    total = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    assert packed.routes.shape == (2, 20, 2)
    start = 0
    for p, r, rec in zip(prompts, responses, routes):
        n = len(p) + len(r)
        assert torch.equal(packed.routes[:, start:start + n - 1].long(), rec.long())
        assert (packed.routes[:, start + n - 1] == OWN_ROUTE).all()
        start += n
    assert (packed.routes[:, total:] == OWN_ROUTE).all()
    inputs = packed_model_inputs(packed)
    own, logits = _row_routes(model, inputs)
    replayed, replayed_logits = _row_routes(model, inputs, replay=list(packed.routes))
    assert torch.equal(replayed.sort(-1).values, own.sort(-1).values)
    torch.testing.assert_close(replayed_logits, logits, rtol=0, atol=1e-6)
    forced = torch.where(packed.routes == OWN_ROUTE, packed.routes, torch.tensor([0, 1], dtype=packed.routes.dtype))
    got, _ = _row_routes(model, inputs, replay=list(forced))
    keep = (forced != OWN_ROUTE).all(-1)
    assert (got[keep].sort(-1).values == torch.tensor([0, 1])).all()
    assert torch.equal(got[~keep], own[~keep])

    shared = pack_shared_prompts(prompts, responses, routes=routes)
    row = shared.model_row
    assert shared.routes.shape == (2, row.total_len, 2)
    p0, p1 = len(ids[0]), len(ids[1])
    expected = torch.cat([routes[0][:, :p0 + 2], torch.full((2, 1, 2), OWN_ROUTE), routes[1][:, p0:p0 + 1],
                          torch.full((2, 1, 2), OWN_ROUTE), routes[2][:, :p1], torch.full((2, 1, 2), OWN_ROUTE)],
                         dim=1)
    assert torch.equal(shared.routes.long(), expected.long())


def test_a_replayed_packed_row_scores_the_sampled_tokens_as_generation_did():
    """Near-tied routers (spread 1e-7): the packed training forward of the engine's samples, on the same weights,
    routes some tokens elsewhere than generation and its log-probs at the sampled tokens are those of other experts
    (a gap over 1e-4); replaying the pack's routes, its routers run exactly the recorded experts and the gap is
    float32 rounding (measured ~5e-7; asserted under 2e-6)."""
    model, tokenizer = tiny_moe(router_spread=1e-7, attn_implementation="sdpa"), load_bundled_tokenizer()
    ids = _ids(tokenizer, PROMPTS)
    requests = [Request((g, s), ids[g], 12, seed=10 * g + s) for g in range(4) for s in range(2)]
    engine = ContinuousEngine(model, eos_id=NEVER, pad_id=tokenizer.pad_token_id, temperature=1.0, record_routes=True,
                              min_shared_prefix=1, max_live_rows=5)
    generated = engine.run(requests)
    packed = pack_sequences([ids[g.key[0]] for g in generated], [g.new_ids for g in generated],
                            routes=[g.routes for g in generated])
    set_attention(model, "sdpa_segments")  # the packed row's per-sequence attention, as training runs it
    sampled_logprobs = torch.tensor([x for g in generated for x in g.logprobs])
    scored = packed.response_positions[0]
    recorded = (packed.routes >= 0).all(dim=-1)

    def forward(replay: bool):
        with torch.no_grad(), routing(model, record=True, replay=list(packed.routes) if replay else None) as routes:
            logits = model(**packed_model_inputs(packed)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, packed.labels[0].clamp(min=0)[:, None])[:, 0]
        return (logprobs[scored] - sampled_logprobs).abs().max().item(), routes.stacked_indices().sort(-1).values

    gap_replayed, routes_replayed = forward(True)
    gap_own, routes_own = forward(False)
    want = packed.routes.long().sort(-1).values
    assert torch.equal(routes_replayed[recorded], want[recorded])
    assert not torch.equal(routes_own[recorded], want[recorded])
    assert gap_own > 1e-4 and gap_replayed < 2e-6, (gap_own, gap_replayed)


def test_replaying_the_routers_own_choice_changes_no_gradient_and_other_experts_still_train_the_router(setup):
    """The replayed gate (`replayed_scores`) is the router's own gate: replaying the routes the router picks gives
    the same loss and every parameter's gradient as no replay; replaying other experts still gives the router a
    gradient (through the weights it gives the experts it is told to use)."""
    model, tokenizer = setup
    ids = torch.tensor([_ids(tokenizer, PROMPTS[3:])[0]])

    def loss_and_grads(replay):
        model.zero_grad()
        with routing(model, record=True, replay=replay) as routes:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, routes

    loss, grads, routes = loss_and_grads(None)
    own = [routes.indices[i] for i in sorted(routes.indices)]
    replayed_loss, replayed_grads, _ = loss_and_grads(own)
    torch.testing.assert_close(replayed_loss, loss, rtol=0, atol=1e-6)
    assert replayed_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(replayed_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
    other = [(i + 1) % 4 for i in own]  # every token sent to another pair of the 4 experts
    _, forced, _ = loss_and_grads(other)
    routers = [n for n in forced if n.endswith("gate.weight")]
    assert len(routers) == 2 and all(forced[n].abs().sum() > 0 for n in routers)
    model.zero_grad()
