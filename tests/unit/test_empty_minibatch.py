"""A mini-batch with no counted token (rollout rejection dropped every one of its tokens) is no optimizer step
(docs/loss.md, "A mini-batch with no counted token"): zero loss, zero gradient norm logged, and the weights and the
AdamW state (moments, step count) left exactly as they were, although AdamW with weight decay and non-zero moments
moves the weights on a zero gradient. One process, the product's `update_on_minibatch`, a tiny policy."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fsdptrain.model.attention_switch import set_attention
from fsdptrain.metrics.typed import finalize
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets
from fsdptrain.train.optim import NonFiniteGuard
from fsdptrain.train.step import MiniBatch, packed_policy_loss, update_on_minibatch

PROMPTS = [[1, 5, 9], [1, 7]]
RESPONSES = [[4, 4, 6, 2], [9, 2, 17]]
SETTINGS = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                              seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.01,
                              temperature=1.0, chunk_size=4)


def _batch(counted: bool) -> MiniBatch:
    gen = torch.Generator().manual_seed(3)
    targets = [SeqTargets(old_logprobs=-3.0 + 0.3 * torch.randn(len(r), generator=gen),
                          advantages=torch.randn(len(r), generator=gen),
                          response_mask=torch.full((len(r),), counted)) for r in RESPONSES]
    return MiniBatch(PROMPTS, RESPONSES, targets)


def _update(policy, optimizer, batch: MiniBatch):
    return update_on_minibatch(policy, optimizer, batch, loss_fn=packed_policy_loss, settings=SETTINGS, dp_size=1,
                               loss_scale_factor=None, token_budget=16, grad_clip=1.0, guard=NonFiniteGuard(3),
                               device=torch.device("cpu"))


def test_a_minibatch_without_counted_tokens_is_no_optimizer_step():
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                          tie_word_embeddings=False)).float()
    set_attention(policy, "sdpa_segments")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    _update(policy, optimizer, _batch(counted=True))  # moments and step count now non-zero
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}

    metrics, outcome = _update(policy, optimizer, _batch(counted=False))

    assert outcome.norms.global_num_tokens == 0 and outcome.norms.global_num_seqs == 0
    assert outcome.grad_norm == 0.0 and not outcome.skipped
    assert finalize(metrics)["pg_loss"] == 0.0
    for name, param in policy.named_parameters():
        assert torch.equal(param.detach(), weights[name]), name
        assert param.grad is None, name
        for key, value in optimizer.state[param].items():
            assert torch.equal(value, state[param][key]), (name, key)
