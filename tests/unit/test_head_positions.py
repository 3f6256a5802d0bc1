"""The output head runs at the response-scoring positions only (fsdptrain/rl/fused_loss.py
`token_logprobs_entropy`): at those positions the log-probs and entropies, and the gradients they give the hidden
states and the head, are the whole row's; every other position holds 0 and gets no gradient."""

from __future__ import annotations

import torch

from fsdptrain.data.packing import pack_sequences
from fsdptrain.rl import fused_loss
from fsdptrain.rl.logprobs import chunked_logprobs_entropy

PROMPTS = [[1, 5, 9, 4, 4], [1, 7], [1, 3, 3, 8, 2, 6, 6]]
RESPONSES = [[4, 6, 2], [9, 2], [10, 2]]


def test_head_sees_only_scored_positions_and_their_values_are_the_whole_rows(monkeypatch):
    packed = pack_sequences(PROMPTS, RESPONSES, pad_to=24)
    gen = torch.Generator().manual_seed(0)
    hidden_TH = torch.randn(24, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight_VH = torch.randn(14, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    seen_rows = []

    def counting(hidden, *args, **kwargs):
        seen_rows.append(hidden.shape[0])
        return chunked_logprobs_entropy(hidden, *args, **kwargs)

    monkeypatch.setattr(packed_loss, "chunked_logprobs_entropy", counting)
    logprobs_T, entropy_T = packed_loss.token_logprobs_entropy(hidden_TH, weight_VH, None, packed, temperature=0.7,
                                                               chunk_size=3)
    assert seen_rows == [sum(map(len, RESPONSES))]  # 7 scored positions of a 24-token row
    mask_T = packed.response_mask[0]
    targets_T = torch.where(packed.label_mask[0], packed.labels[0], torch.zeros_like(packed.labels[0]))
    full_lp_T, full_ent_T = chunked_logprobs_entropy(hidden_TH, weight_VH, targets_T, temperature=0.7, chunk_size=3)
    torch.testing.assert_close(logprobs_T[mask_T], full_lp_T[mask_T], rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy_T[mask_T], full_ent_T[mask_T], rtol=0, atol=1e-12)
    assert not logprobs_T[~mask_T].any() and not entropy_T[~mask_T].any()

    coef_T = torch.randn(24, generator=gen, dtype=torch.float64) * mask_T
    grads = torch.autograd.grad((coef_T * (logprobs_T + 0.1 * entropy_T)).sum(), (hidden_TH, weight_VH))
    want = torch.autograd.grad((coef_T * (full_lp_T + 0.1 * full_ent_T)).sum(), (hidden_TH, weight_VH))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert not grads[0][~mask_T].any()
