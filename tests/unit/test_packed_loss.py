"""The fused packed loss equals the per-sequence reference (one sequence at a time, unpacked, naive log-softmax)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from fsdptrain.check.per_sequence import per_sequence_policy_loss, per_sequence_value_loss, reference_policy_outputs
from fsdptrain.data.packing import pack_sequences, unpack_responses
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import finalize, merge_all
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.fused_loss import SeqTargets, ValueLossSettings, scatter_responses
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.pack_losses import packed_policy_loss, packed_value_loss
from tests.helpers.attention_call_counts import call_counts, reset_call_counts

PROMPTS = [[1, 5, 9], [1, 7], [1, 3, 3, 8, 2], [1], [1, 11, 12]]
RESPONSES = [[4, 4, 6, 2], [9, 2], [10, 13, 2], [5, 6, 7, 8, 9, 2], [3]]
PACKS = [[0, 3], [1, 2, 4]]  # two micro-batches, uneven


def _config(tie: bool, **extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                       max_position_embeddings=64, **extra)


def _policy(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(tie)).float()
    set_attention(model, "sdpa_segments")
    return model


def _targets(model, *, temperature: float) -> list[SeqTargets]:
    gen = torch.Generator().manual_seed(1)
    out = []
    with torch.no_grad():
        for p, r in zip(PROMPTS, RESPONSES):
            logp, _ = reference_policy_outputs(model, p, r, temperature=temperature)
            n = len(r)
            out.append(SeqTargets(
                old_logprobs=logp + 0.3 * torch.randn(n, generator=gen),
                advantages=torch.randn(n, generator=gen),
                ref_logprobs=logp + 0.2 * torch.randn(n, generator=gen),
                old_values=torch.randn(n, generator=gen),
                returns=torch.randn(n, generator=gen),
            ))
    return out


def _norms(mode: str) -> LossNormalizers:
    num_tokens = sum(len(r) for r in RESPONSES)
    return LossNormalizers(global_num_tokens=num_tokens, global_num_seqs=len(RESPONSES), dp_size=1,
                           loss_scale_factor=8.0)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_metrics(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


def _assert_close_grads(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    scale = max(g.abs().max().item() for g in want.values())
    for name in want:
        assert (got[name] - want[name]).abs().max().item() <= 1e-6 * scale, name


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_fused_policy_loss_equals_per_sequence_reference(mode, tie):
    model = _policy(tie)
    settings = PolicyLossSettings(agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                  seq_level_ratio=False, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
                                  temperature=0.7, chunk_size=5, use_reference=True)
    targets = _targets(model, temperature=0.7)
    norms = _norms(mode)

    model.zero_grad()
    ref_loss, ref_metrics = per_sequence_policy_loss(model, PROMPTS, RESPONSES, targets, norms=norms,
                                                     settings=settings)
    ref_loss.backward()
    ref_grads = _grads(model)

    model.zero_grad()
    reset_call_counts()
    total, collected = 0.0, []
    for pack in PACKS:
        packed = pack_sequences(PROMPTS, RESPONSES, pack)
        loss, metrics = packed_policy_loss(model, packed, [targets[i] for i in pack], norms=norms,
                                           settings=settings)
        loss.backward()
        total += loss.item()
        collected.append(metrics)
    assert call_counts()["sdpa_segments"] > 0, "the packed backend did not run"
    assert total == pytest.approx(ref_loss.item(), rel=1e-6)
    _assert_close_metrics(finalize(merge_all(collected)), finalize(ref_metrics))
    _assert_close_grads(_grads(model), ref_grads)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fused_value_loss_equals_per_sequence_reference(mode):
    torch.manual_seed(0)
    critic = LlamaForTokenClassification(_config(False, num_labels=1))
    for module in critic.modules():  # the token-classification head defaults to dropout 0.1
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    set_attention(critic, "sdpa_segments")
    targets = _targets(_policy(True), temperature=1.0)
    settings = ValueLossSettings(agg_mode=mode, cliprange_value=0.2)
    norms = _norms(mode)

    critic.zero_grad()
    ref_loss, ref_metrics = per_sequence_value_loss(critic, PROMPTS, RESPONSES, targets, norms=norms,
                                                    settings=settings)
    ref_loss.backward()
    ref_grads = _grads(critic)

    critic.zero_grad()
    total, collected = 0.0, []
    for pack in PACKS:
        packed = pack_sequences(PROMPTS, RESPONSES, pack)
        loss, metrics = packed_value_loss(critic, packed, [targets[i] for i in pack], norms=norms, settings=settings)
        loss.backward()
        total += loss.item()
        collected.append(metrics)
    assert total == pytest.approx(ref_loss.item(), rel=1e-6)
    _assert_close_metrics(finalize(merge_all(collected)), finalize(ref_metrics))
    _assert_close_grads(_grads(critic), ref_grads)


def test_empty_pack_gives_zero_loss_and_the_same_metric_names():
    model = _policy(True)
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                                  seq_level_ratio=False, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.0,
                                  temperature=1.0, chunk_size=4, use_reference=True)
    targets = _targets(model, temperature=1.0)
    norms = _norms("token-mean")
    empty = pack_sequences([], [])
    loss, metrics = packed_policy_loss(model, empty, [], norms=norms, settings=settings)
    loss.backward()
    assert loss.item() == 0.0
    full = pack_sequences(PROMPTS, RESPONSES)
    _, full_metrics = packed_policy_loss(model, full, targets, norms=norms, settings=settings)
    assert set(metrics) == set(full_metrics)
    assert "probs_ratio_min" not in finalize(metrics)  # an empty extremum is absent, never 0.0


def test_scatter_responses_inverts_unpack_responses():
    packed = pack_sequences(PROMPTS, RESPONSES, [4, 0, 2])
    per_seq = [torch.arange(len(RESPONSES[i]), dtype=torch.float32) + 10 * i for i in (4, 0, 2)]
    row = scatter_responses(per_seq, packed)
    for got, want in zip(unpack_responses(row, packed), per_seq):
        assert torch.equal(got, want)
    assert row[~packed.response_mask[0]].abs().sum() == 0
