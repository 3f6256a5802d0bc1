"""The drafter's refresh passes (`drafter.refresh_passes`): after the policy's optimizer step, each pass trains the
drafter against the UPDATED policy, leaves the policy's weights bit-identical, and leaves the step's metrics those
of the joint pass. One process, plain modules, the product's `update_on_minibatch`; the reference gradient is the
per-sequence oracle's on the updated policy."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fsdptrain.check.draft_per_sequence import per_sequence_draft_loss
from fsdptrain.data.packing import pack_sequences, plan_packs
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.drafter import Eagle3Drafter, build_draft_vocab
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import finalize
from fsdptrain.train.cotrain import DraftLossSettings, DrafterUpdate
from fsdptrain.train.optim import NonFiniteGuard
from fsdptrain.rl.draft_loss import count_draft_tokens_and_seqs
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets
from fsdptrain.train.step import MiniBatch, packed_policy_loss, update_on_minibatch

VOCAB = 32
PROMPTS = [[1, 5, 9], [1, 7], [1, 3, 3, 8, 2], [1], [1, 11, 12]]
RESPONSES = [[4, 4, 6, 2], [9, 2, 17, 21], [10, 13, 2], [5], [3, 30, 31]]
TOKEN_BUDGET = 12
SETTINGS = PolicyLossSettings(agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                              clip_ratio_c=3.0, seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3",
                              entropy_coef=0.0, temperature=0.7, chunk_size=3)
LOSS_WEIGHT = 0.5
# the drafter's step is plain SGD at lr 1 without a clip, so each refresh step moves the weights by minus the pass's
# gradient exactly; fp32, chunked soft CE against the oracle's plain softmax
GRAD_TOLERANCE = 1e-5


def _start() -> tuple[torch.nn.Module, Eagle3Drafter]:
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, tie_word_embeddings=False)).float()
    set_attention(policy, "sdpa_segments")
    vocab = build_draft_vocab([p + r for p, r in zip(PROMPTS, RESPONSES)], vocab_size=VOCAB, draft_vocab_size=14)
    torch.manual_seed(1)
    drafter = Eagle3Drafter.from_policy(policy, vocab, feature_layers=(0, 1, 2))
    with torch.no_grad():  # away from the warm start so the draft loss has a gradient
        drafter.lm_head.weight.add_(0.3 * torch.randn_like(drafter.lm_head.weight))
    return policy, drafter


def _batch() -> MiniBatch:
    gen = torch.Generator().manual_seed(3)
    targets = [SeqTargets(old_logprobs=-3.0 + 0.3 * torch.randn(len(r), generator=gen),
                          advantages=torch.randn(len(r), generator=gen)) for r in RESPONSES]
    return MiniBatch(PROMPTS, RESPONSES, targets)


def _draft_norms() -> LossNormalizers:
    plan = plan_packs([len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)], TOKEN_BUDGET)
    counts = [count_draft_tokens_and_seqs(pack_sequences(PROMPTS, RESPONSES, pack), on="response")
              for pack in plan.packs]
    return LossNormalizers(global_num_tokens=sum(c[0] for c in counts), global_num_seqs=sum(c[1] for c in counts),
                           dp_size=1, loss_scale_factor=None)


def _run(refresh_passes: int):
    """One mini-batch of the product path from the same start; the policy, the drafter and the metrics after."""
    policy, drafter = _start()
    update = DrafterUpdate(module=drafter, optimizer=torch.optim.SGD(drafter.parameters(), lr=1.0), grad_clip=0.0,
                           guard=NonFiniteGuard(3), loss=DraftLossSettings(on="response", loss_weight=LOSS_WEIGHT,
                                                                           backend="sdpa_segments"),
                           refresh_passes=refresh_passes)
    metrics, outcome = update_on_minibatch(
        policy, torch.optim.AdamW(policy.parameters(), lr=3e-2), _batch(), loss_fn=packed_policy_loss,
        settings=SETTINGS, dp_size=1, loss_scale_factor=None, token_budget=TOKEN_BUDGET, grad_clip=1.0,
        guard=NonFiniteGuard(3), device=torch.device("cpu"), auxiliary=update)
    assert finalize(outcome.auxiliary)["drafter/global_num_tokens"] == _draft_norms().global_num_tokens
    return policy, drafter, finalize(metrics)


def _oracle_grads(policy, drafter) -> dict[str, torch.Tensor]:
    """The draft loss's gradient for `drafter` with `policy` as the teacher, one sequence at a time."""
    drafter = copy.deepcopy(drafter)
    loss, _ = per_sequence_draft_loss(policy, drafter, PROMPTS, RESPONSES, norms=_draft_norms(),
                                      agg_mode=SETTINGS.agg_mode, on="response", temperature=SETTINGS.temperature)
    (LOSS_WEIGHT * loss).backward()
    return {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}


def _relative(got: dict, want: dict) -> float:
    scale = max(v.abs().max().item() for v in want.values())
    return max((got[n] - want[n]).abs().max().item() for n in want) / scale


@pytest.fixture(scope="module")
def runs():
    return {passes: _run(passes) for passes in (0, 1)}


def test_refresh_pass_is_taught_by_the_updated_policy(runs):
    policy_0, drafter_0, _ = runs[0]  # the joint pass only: the stepped policy, the drafter after its joint step
    _, drafter_1, _ = runs[1]
    step = {n: drafter_0.state_dict()[n] - p.detach() for n, p in drafter_1.named_parameters()}  # SGD lr 1: the grad
    _, initial_drafter = _start()
    initial_policy, _ = _start()
    updated_teacher = _oracle_grads(policy_0, drafter_0)
    stale_teacher = _oracle_grads(initial_policy, drafter_0)
    assert _relative(step, updated_teacher) <= GRAD_TOLERANCE
    # the test can tell the teachers apart: the pre-step policy's gradient is far from the refresh step
    assert _relative(step, stale_teacher) > 100 * GRAD_TOLERANCE
    assert any(not torch.equal(a, b) for a, b in zip(drafter_0.parameters(), initial_drafter.parameters()))


def test_refresh_leaves_the_policy_and_the_metrics_of_the_joint_pass(runs):
    policy_0, _, metrics_0 = runs[0]
    policy_1, _, metrics_1 = runs[1]
    for (name, a), b in zip(policy_0.state_dict().items(), policy_1.state_dict().values()):
        assert torch.equal(a, b), name
    assert metrics_1 == metrics_0
    assert {"drafter/loss", "drafter/accept_prob"} <= set(metrics_1)
