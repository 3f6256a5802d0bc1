"""The load-balancing loss (fsdptrain/rl/moe_aux_loss.py): transformers' value on one forward, a hand-worked value,
and the global definition under every split (micro-batches, packs, ranks, padding, shared prompts), value and
gradient; the per-micro-batch mean (what a trainer gets by adding transformers' aux loss per forward) fails the
split test.

Legend: L layers, T tokens, E experts, k chosen per token; `_LTE` one logits tensor per layer.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fsdptrain.metrics.typed import finalize, merge_all
from fsdptrain.rl.moe_aux_loss import (
    MoeNormalizers,
    aux_loss_share,
    load_cv,
    local_expert_counts,
    moe_metrics,
    whole_batch_aux_loss,
)

L, E, K = 3, 4, 2


def routes(logits_LTE):
    """Each layer's top-k of its softmax: what the routers choose."""
    return [torch.topk(torch.softmax(x.detach().double(), -1), K, dim=-1).indices for x in logits_LTE]


def draw(num_tokens: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.randn(L, num_tokens, E, dtype=torch.float64) * 2).requires_grad_()


def test_equals_transformers_on_one_unpadded_sequence():
    logits = draw(7)
    ours = whole_batch_aux_loss(list(logits), routes(logits), torch.ones(7))
    theirs = load_balancing_loss_func(tuple(logits), E, K)
    assert torch.allclose(ours, theirs.double(), rtol=1e-6, atol=0)  # theirs sums in float32


def test_equals_transformers_on_a_padded_batch_with_its_attention_mask():
    logits = draw(2 * 5)  # [B=2, S=5] flattened, as transformers' routers see it
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ours = whole_batch_aux_loss(list(logits), routes(logits), mask.reshape(-1))
    theirs = load_balancing_loss_func(tuple(logits), E, K, attention_mask=mask)
    assert torch.allclose(ours, theirs.double(), rtol=1e-6, atol=0)


def test_hand_worked_value_one_layer_two_tokens():
    # E = 2, k = 1, L = 1; logits make p_0 = (3/4, 1/4), p_1 = (1/4, 3/4): both choose their own expert.
    # C = (1, 1), S = (1, 1), N = 2: aux = 2 * (1/2 * 1/2 + 1/2 * 1/2) = 1 (balanced: k = 1).
    logits = torch.log(torch.tensor([[[0.75, 0.25], [0.25, 0.75]]], dtype=torch.float64))
    assert whole_batch_aux_loss(list(logits), [torch.tensor([[0], [1]])], torch.ones(2)).item() == pytest.approx(1.0)
    # Both on expert 0 (p_1 = (3/4, 1/4) too): C = (2, 0), S = (3/2, 1/2): aux = 2 * (1 * 3/4) = 3/2.
    logits = torch.log(torch.tensor([[[0.75, 0.25], [0.75, 0.25]]], dtype=torch.float64))
    assert whole_batch_aux_loss(list(logits), [torch.tensor([[0], [0]])], torch.ones(2)).item() == pytest.approx(1.5)


# ---- the global definition under every split --------------------------------------------------------------------


def global_norms(logits, weights) -> MoeNormalizers:
    return MoeNormalizers(coef=1.0, expert_counts_LE=local_expert_counts(routes(logits), weights, E),
                          num_tokens=int(weights.sum()))


def split_loss(logits, weights, parts: list[list[list[int]]], norms: MoeNormalizers, share=aux_loss_share):
    """``parts[r][m]``: the token positions of rank r's micro-batch m. Every micro-batch's share with the global
    norms and dp_size = ranks; the loss FSDP's gradient is that of: the mean over ranks of each rank's summed
    shares."""
    ranks = len(parts)
    total = 0.0
    for rank in parts:
        for positions in rank:
            index = torch.tensor(positions, dtype=torch.long)
            total = total + share([x[index] for x in logits], weights[index], norms, dp_size=ranks)
    return total / ranks


SPLITS = {
    "one forward": [[list(range(12))]],
    "micro-batches 5+7": [[list(range(5)), list(range(5, 12))]],
    "one token each": [[[t] for t in range(12)]],
    "two ranks, uneven": [[[0, 1, 2], [3]], [[4, 5, 6, 7, 8, 9, 10, 11]]],
    "two ranks, an empty micro-batch": [[list(range(12))], [[]]],
    "three ranks, interleaved": [[[0, 3, 6, 9]], [[1, 4, 7, 10]], [[2, 5], [8, 11]]],
}


def assert_split_exact(split, share=aux_loss_share):
    logits = draw(12)
    weights = torch.ones(12)
    whole = whole_batch_aux_loss(list(logits), routes(logits), weights)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    got = split_loss(logits, weights, split, global_norms(logits, weights), share)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert math.isclose(got.item(), whole.item(), rel_tol=1e-12), (got.item(), whole.item())
    assert torch.allclose(got_grad, whole_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", SPLITS)
def test_any_split_gives_the_whole_batch_value_and_gradient(name):
    assert_split_exact(SPLITS[name])


def per_forward_mean(logits_LTE, weights_T, norms, *, dp_size=1):
    """The bug: each forward's own transformers value, micro-batches averaged by their count (here: by the dp
    factor's inverse, as each forward's scalar enters a loss that FSDP averages)."""
    return whole_batch_aux_loss(logits_LTE, routes(logits_LTE), weights_T) * dp_size if len(weights_T) else 0.0


def test_the_split_test_fails_on_the_per_micro_batch_value():
    with pytest.raises(AssertionError):
        assert_split_exact(SPLITS["micro-batches 5+7"], share=per_forward_mean)
    with pytest.raises(AssertionError):
        assert_split_exact(SPLITS["two ranks, uneven"], share=per_forward_mean)


def test_padding_counts_for_nothing_value_and_gradient():
    """Padding tokens (weight 0, any finite logits) between and after real ones change neither value nor gradient."""
    logits = draw(12)
    weights = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1], dtype=torch.float64)
    real = weights.nonzero().squeeze(-1)
    reference = whole_batch_aux_loss([x[real] for x in logits], routes([x[real] for x in logits]), weights[real])
    (reference_grad,) = torch.autograd.grad(reference, logits)
    padded = split_loss(logits, weights, [[list(range(6)), list(range(6, 12))]], global_norms(logits, weights))
    (padded_grad,) = torch.autograd.grad(padded, logits)
    assert math.isclose(padded.item(), reference.item(), rel_tol=1e-12)
    assert torch.allclose(padded_grad, reference_grad, rtol=1e-10, atol=1e-14)
    assert padded_grad[:, weights == 0].abs().max() == 0
    # counting them (weight 1) is another number
    counted = whole_batch_aux_loss(list(logits), routes(logits), torch.ones(12))
    assert not math.isclose(counted.item(), reference.item(), rel_tol=1e-6)


def test_a_token_of_weight_two_is_two_copies_of_it():
    """A shared-prompt row holds a prompt token once for n sequences: weight n is the same loss as n copies."""
    logits = draw(5)
    copies = [x[torch.tensor([0, 0, 1, 2, 3, 4, 4, 4])] for x in logits]
    reference = whole_batch_aux_loss(copies, routes(copies), torch.ones(8))
    weights = torch.tensor([2.0, 1, 1, 1, 3])
    shared = aux_loss_share(list(logits), weights, global_norms(logits, weights))
    assert math.isclose(shared.item(), reference.item(), rel_tol=1e-12)


def test_no_counted_token_is_zero():
    logits = draw(3)
    norms = MoeNormalizers(coef=1.0, expert_counts_LE=torch.zeros(L, E, dtype=torch.float64), num_tokens=0)
    assert aux_loss_share(list(logits), torch.zeros(3), norms).item() == 0.0


# ---- metrics ----------------------------------------------------------------------------------------------------


def test_load_metrics_by_hand_and_exact_under_a_split():
    # one layer, E = 4, counts (6, 2, 0, 0): shares 3/4 and 0; mean 2, std sqrt((16 + 0 + 4 + 4) / 4) = sqrt(6)
    counts = torch.tensor([[6.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    whole = finalize(moe_metrics(counts, None))
    assert whole == {"moe/layer_0/load_max_share": 0.75, "moe/layer_0/load_min_share": 0.0,
                     "moe/layer_0/load_cv": pytest.approx(math.sqrt(6) / 2, rel=1e-15)}
    halves = [torch.tensor([[1.0, 2.0, 0.0, 0.0]]), torch.tensor([[5.0, 0.0, 0.0, 0.0]])]
    assert finalize(merge_all(moe_metrics(c, None) for c in halves)) == whole
    assert load_cv([1.0, 1.0, 1.0]) == 0.0 and load_cv([0.0, 0.0]) is None
