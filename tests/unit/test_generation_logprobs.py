"""Generation log-probs (``Rollout.generation_logprobs``, docs/rollout.md): each engine records every sampled token's
``log_softmax(logits / temperature)`` as an independent full-sequence forward computes it; ``rollout/logprob_diff/*``
pools |old - generated| over policy tokens, so splitting the rollouts over ranks gives the same numbers; with the old
pass skipped, the first update forward pools the same over its packed rows."""

from __future__ import annotations

import pytest
import torch

from fsdptrain.data.packing import pack_sequences
from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.generate import generate_responses
from fsdptrain.metrics.typed import finalize, merge_all
from fsdptrain.generation.continuous import ContinuousEngine
from fsdptrain.generation.decoder import Request
from fsdptrain.rl.fused_loss import SeqTargets, generation_gap_metrics, scatter_responses
from fsdptrain.train.experience import logprob_diff_metrics
from tests.helpers.tiny_llama import tiny_llama

PROMPTS = ["repeat 7 =", "copy 3 1 4 =", "repeat 2 =", "sort 9 8 7 6 5 ="]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup():
    tokenizer = load_bundled_tokenizer()
    model = tiny_llama(len(tokenizer), num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
                       attn_implementation="sdpa")
    return model.eval(), tokenizer


def _reference(model, prompt_ids, response_ids):
    """One sequence alone, no cache: log_softmax(logits / T) at each response token."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def test_generate_records_the_generating_forwards_logprobs(setup):
    model, tokenizer = setup
    ids = [tokenizer(t)["input_ids"] for t in PROMPTS]
    out = generate_responses(model, tokenizer, ids, max_new_tokens=12, temperature=TEMPERATURE, top_p=1.0,
                             do_sample=True, generator_seed=3, device=torch.device("cpu"), record_logprobs=True)
    for prompt, response, _, logprobs in out:
        assert len(logprobs) == len(response) > 0
        torch.testing.assert_close(torch.tensor(logprobs), _reference(model, prompt, response), rtol=0, atol=1e-5)


def test_the_continuous_engine_records_the_generating_forwards_logprobs(setup):
    model, tokenizer = setup
    ids = [tokenizer(t)["input_ids"] for t in PROMPTS]
    engine = ContinuousEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                              temperature=TEMPERATURE)
    for f in engine.run([Request(i, p, 12, seed=20 + i) for i, p in enumerate(ids)]):
        torch.testing.assert_close(torch.tensor(f.logprobs), _reference(model, ids[f.key], f.new_ids),
                                   rtol=0, atol=1e-5)


def test_logprob_diff_pools_policy_tokens_over_ranks():
    old = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -0.25]), torch.tensor([-4.0])]
    generated = [torch.tensor([-1.5, -2.0, -1.0]), torch.tensor([-0.75, -0.25]), None]
    masks = [torch.tensor([1, 1, 0]), None, None]  # sequence 0's last token is a tool's: it does not count
    # policy tokens: |0.5|, |0|, then |0.25|, |0|; sequence 2 carries none -> mean 0.75 / 4, max 0.5
    whole = finalize(logprob_diff_metrics(old, generated, masks))
    assert whole == {"rollout/logprob_diff/mean": pytest.approx(0.1875, abs=1e-7),
                     "rollout/logprob_diff/max": pytest.approx(0.5, abs=1e-7)}
    split = finalize(merge_all([logprob_diff_metrics(old[:1], generated[:1], masks[:1]),
                                logprob_diff_metrics(old[1:], generated[1:], masks[1:])]))
    assert split == whole
    assert finalize(logprob_diff_metrics(old[2:], generated[2:], masks[2:])) == {}


def test_the_update_forward_pools_the_same_gap_at_any_packing():
    # The same hand numbers as above, from the first update forward (the old pass skipped): the forward's log-probs
    # on the packed row against the targets' generation log-probs, over the row's counted tokens.
    old = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -0.25]), torch.tensor([-4.0])]
    generated = [torch.tensor([-1.5, -2.0, -1.0]), torch.tensor([-0.75, -0.25]), None]
    masks = [torch.tensor([True, True, False]), None, None]
    prompts, responses = [[5, 6], [7], [8, 9, 10]], [[11, 12, 13], [14, 15], [16]]
    targets = [SeqTargets(old_logprobs=None, advantages=torch.zeros(len(r)), generation_logprobs=g,
                          response_mask=m) for r, g, m in zip(responses, generated, masks)]

    def gap(pack):
        packed = pack_sequences(prompts, responses, pack, response_masks=masks)
        logprobs_T = scatter_responses([old[i] for i in pack], packed)
        return generation_gap_metrics(logprobs_T, packed, [targets[i] for i in pack])

    want = {"rollout/logprob_diff/mean": pytest.approx(0.1875, abs=1e-7),
            "rollout/logprob_diff/max": pytest.approx(0.5, abs=1e-7)}
    assert finalize(gap([0, 1, 2])) == want
    assert finalize(merge_all([gap([2, 0]), gap([1])])) == want  # two packs (or two ranks), another order
    assert finalize(gap([2])) == {} and finalize(gap([])) == {}  # nothing carried: absent, never 0.0
