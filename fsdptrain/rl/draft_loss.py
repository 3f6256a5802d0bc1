"""The co-trained drafter's loss: soft cross-entropy to the policy's next-token distribution on the draft vocabulary.

Legend: `_T` per-position tensors of one packed row `[T]` (aligned with the input: row position t), `_TH` `[T, H]`,
`_DH` `[D, H]` (D = draft vocabulary size), `_CD` one chunk of positions `[C, D]`, `_n`/`_nD` one sequence alone.

The shift. At row position t the drafter sees the policy's features at t and the token at t+1 and predicts the token
at t+2. Its teacher is the policy's own next-token distribution at t+1 (which predicts t+2):

    p_t = softmax((W[d2t] h_{t+1} + b[d2t]) / temperature)     teacher: the policy's last hidden state at t+1, only
                                                                the D draft rows of its output projection, renormalised
    q_t = softmax(U g_t / temperature)                          draft: the drafter's final hidden g_t, its head U [D, H]
    ce_t = -sum_d p_t[d] log q_t[d]                             soft cross-entropy; d ce_t / d z_draft = (q_t - p_t) / T

Position t counts (`draft_mask`) when tokens t+1 and t+2 both lie in t's sequence (the shift never crosses a packed
segment) and, with `on='response'`, token t+2 is a response token. Both logits use the same temperature, so the
drafter's raw logits imitate the policy's raw logits, which is what an engine that applies the request's temperature
to both models needs.

Memory: `chunked_soft_cross_entropy` never holds a `[T, D]` (nor, a fortiori, `[T, V]`) tensor across chunks: the
forward keeps two `[T]` log-sum-exps, and the backward recomputes each chunk's logits (as
`chunked_logprobs_entropy` does).

Departures from NeMo RL's `DraftCrossEntropyLossFn` (soft CE = -sum p log_softmax(student), token-mean by the
policy's global valid-token count): the draft loss here is aggregated with the run's `agg_loss` mode and with its OWN
global counts (`count_draft_tokens_and_seqs`), because the draft mask is not the response mask (the draft
positions of a response are P-2 .. P+R-3, one fewer when the prompt is one token, none for a 2-token sequence; with
`on='all'` a sequence of n tokens has n-2); the policy's counts would be the wrong denominator. No
training-time-test (multi-step unrolled) passes: one draft step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fsdptrain.registry.names import DRAFT_ON
from fsdptrain.rl.aggregate import LossNormalizers, agg_loss_with, check_mode, count_tokens_and_seqs
from fsdptrain.metrics.typed import Loss, Mean, Metrics
from fsdptrain.rl.fused_loss import PackedRow

ACCEPT_WINDOW = 3
_LEN_KEY = f"drafter/expected_accept_len@{ACCEPT_WINDOW}"


def check_on(on: str) -> None:
    if on not in DRAFT_ON:
        raise ValueError(f"drafter.on must be one of {', '.join(DRAFT_ON)}, got {on!r}")


def _next(x_T: Tensor, k: int = 1, fill=0) -> Tensor:
    """x shifted left by k along dim 0: out[t] = x[t + k], `fill` past the end."""
    if k == 0 or x_T.shape[0] == 0:
        return x_T
    pad = x_T.new_full((min(k, x_T.shape[0]), *x_T.shape[1:]), fill)
    return torch.cat([x_T[k:], pad])[: x_T.shape[0]]


def draft_mask(label_mask_T: Tensor, response_mask_T: Tensor, *, on: str) -> Tensor:
    """bool `[T]` (or `[1, T]`, kept): True where the drafter's prediction of token t+2 at position t is scored.

    `label_mask[t]` says token t+1 is in t's sequence, `label_mask[t+1]` that t+2 is; `response_mask[t+1]` that
    t+2 is a response token (a subset of `label_mask[t+1]`). The padding tail and segment ends are never True.
    """
    check_on(on)
    shape = label_mask_T.shape
    label_T, response_T = label_mask_T.reshape(-1).bool(), response_mask_T.reshape(-1).bool()
    later_T = _next(response_T if on == "response" else label_T, 1, False)
    return (label_T & later_T).reshape(shape)


# ---- the chunked soft cross-entropy ----------------------------------------------------------------------------


def _logits(hidden_CH: Tensor, weight_DH: Tensor, bias_D: Optional[Tensor], temperature: float) -> Tensor:
    out_CD = torch.nn.functional.linear(hidden_CH, weight_DH, bias_D)
    return out_CD / temperature if temperature != 1.0 else out_CD


class _ChunkedSoftCE(torch.autograd.Function):
    """Saves the inputs and two `[T]` log-sum-exps; recomputes each chunk's `[C, D]` logits in backward."""

    @staticmethod
    def forward(ctx, draft_hidden_TH, draft_weight_DH, teacher_hidden_TH, teacher_weight_DH, teacher_bias_D,
                temperature, chunk_size):
        dtype = torch.float32 if draft_hidden_TH.dtype != torch.float64 else torch.float64
        num_tokens, device = draft_hidden_TH.shape[0], draft_hidden_TH.device
        ce_T = torch.zeros(num_tokens, dtype=dtype, device=device)
        agree_T, accept_T = torch.zeros_like(ce_T), torch.zeros_like(ce_T)
        lse_draft_T, lse_teacher_T = torch.zeros_like(ce_T), torch.zeros_like(ce_T)
        with torch.autocast(device_type=device.type, enabled=False):
            u_DH, w_DH = draft_weight_DH.to(dtype), teacher_weight_DH.to(dtype)
            b_D = None if teacher_bias_D is None else teacher_bias_D.to(dtype)
            for start in range(0, num_tokens, chunk_size):
                end = min(start + chunk_size, num_tokens)
                teacher_CD = _logits(teacher_hidden_TH[start:end].to(dtype), w_DH, b_D, temperature)
                draft_CD = _logits(draft_hidden_TH[start:end].to(dtype), u_DH, None, temperature)
                lse_teacher_T[start:end] = torch.logsumexp(teacher_CD, dim=-1)
                lse_draft_T[start:end] = torch.logsumexp(draft_CD, dim=-1)
                p_CD = torch.exp(teacher_CD - lse_teacher_T[start:end, None])
                logq_CD = draft_CD - lse_draft_T[start:end, None]
                ce_T[start:end] = -(p_CD * logq_CD).sum(dim=-1)
                agree_T[start:end] = (draft_CD.argmax(dim=-1) == teacher_CD.argmax(dim=-1)).to(dtype)
                accept_T[start:end] = torch.minimum(p_CD, logq_CD.exp()).sum(dim=-1)
        ctx.save_for_backward(draft_hidden_TH, draft_weight_DH, teacher_hidden_TH, teacher_weight_DH, teacher_bias_D,
                              lse_draft_T, lse_teacher_T)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(agree_T, accept_T)
        return ce_T, agree_T, accept_T

    @staticmethod
    def backward(ctx, grad_ce_T, _grad_agree, _grad_accept):
        draft_hidden_TH, draft_weight_DH, teacher_hidden_TH, teacher_weight_DH, teacher_bias_D, lse_draft_T, \
            lse_teacher_T = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, lse_draft_T.dtype
        num_tokens, device = draft_hidden_TH.shape[0], draft_hidden_TH.device
        with torch.autocast(device_type=device.type, enabled=False):
            u_DH, w_DH = draft_weight_DH.to(dtype), teacher_weight_DH.to(dtype)
            b_D = None if teacher_bias_D is None else teacher_bias_D.to(dtype)
            grad_hidden_TH = torch.zeros(draft_hidden_TH.shape, dtype=dtype, device=device) if need_hidden else None
            grad_weight_DH = torch.zeros_like(u_DH) if need_weight else None
            grad_T = grad_ce_T.to(dtype)
            for start in range(0, num_tokens, chunk_size):
                end = min(start + chunk_size, num_tokens)
                hidden_CH = draft_hidden_TH[start:end].to(dtype)
                p_CD = torch.exp(_logits(teacher_hidden_TH[start:end].to(dtype), w_DH, b_D, temperature)
                                 - lse_teacher_T[start:end, None])
                q_CD = torch.exp(_logits(hidden_CH, u_DH, None, temperature) - lse_draft_T[start:end, None])
                # d ce / d z = q - p (the teacher sums to 1); z = U g / temperature
                grad_z_CD = (q_CD - p_CD) * (grad_T[start:end, None] / temperature)
                if need_hidden:
                    grad_hidden_TH[start:end] = grad_z_CD @ u_DH
                if need_weight:
                    grad_weight_DH.addmm_(grad_z_CD.T, hidden_CH)
        if need_hidden:
            grad_hidden_TH = grad_hidden_TH.to(draft_hidden_TH.dtype)
        if need_weight:
            grad_weight_DH = grad_weight_DH.to(draft_weight_DH.dtype)
        return grad_hidden_TH, grad_weight_DH, None, None, None, None, None


def chunked_soft_cross_entropy(draft_hidden_TH: Tensor, draft_weight_DH: Tensor, teacher_hidden_TH: Tensor,
                               teacher_weight_DH: Tensor, *, temperature: float, chunk_size: int,
                               teacher_bias_D: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per position: (soft CE of q to p, 1.0 where argmax q == argmax p, sum_d min(p, q)), `[T]` each, fp32.

    p = softmax((teacher_hidden W^T + b) / temperature), q = softmax(draft_hidden U^T / temperature), both over the
    D draft rows. Only the CE is differentiable, and only with respect to the draft hidden states and U; the teacher
    inputs are read detached. Peak extra memory: a few `[chunk_size, D]` fp32 buffers.
    """
    if draft_hidden_TH.dim() != 2 or teacher_hidden_TH.shape[0] != draft_hidden_TH.shape[0]:
        raise ValueError(f"draft and teacher hidden states must be [T, H] with the same T, got "
                         f"{tuple(draft_hidden_TH.shape)} and {tuple(teacher_hidden_TH.shape)}")
    if draft_weight_DH.shape[0] != teacher_weight_DH.shape[0]:
        raise ValueError(f"the draft head has {draft_weight_DH.shape[0]} rows but the teacher's draft-vocabulary "
                         f"rows are {teacher_weight_DH.shape[0]}: slice the policy head with the drafter's d2t")
    if not temperature > 0 or chunk_size < 1:
        raise ValueError(f"temperature must be > 0 and chunk_size >= 1, got {temperature}, {chunk_size}")
    bias = None if teacher_bias_D is None else teacher_bias_D.detach()
    return _ChunkedSoftCE.apply(draft_hidden_TH, draft_weight_DH, teacher_hidden_TH.detach(),
                                teacher_weight_DH.detach(), bias, float(temperature), int(chunk_size))


def soft_cross_entropy_from_logits(draft_logits_TD: Tensor, teacher_logits_TD: Tensor
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """The unfused reference of `chunked_soft_cross_entropy` on already-scaled logits: plain (log-)softmax."""
    p_TD = torch.softmax(teacher_logits_TD.detach().float(), dim=-1)
    logq_TD = torch.log_softmax(draft_logits_TD.float(), dim=-1)
    ce_T = -(p_TD * logq_TD).sum(dim=-1)
    agree_T = (draft_logits_TD.argmax(dim=-1) == teacher_logits_TD.argmax(dim=-1)).float()
    accept_T = torch.minimum(p_TD, logq_TD.detach().exp()).sum(dim=-1)
    return ce_T, agree_T, accept_T


# ---- metrics and the loss -------------------------------------------------------------------------------------


def expected_accept_len(accept_T: Tensor, mask_T: Tensor, window: int = ACCEPT_WINDOW) -> tuple[Tensor, Tensor]:
    """(E_t, full_t), `[T]` each: E_t = sum_{k=1..window} prod_{j<k} a_{t+j}, defined where positions t..t+window-1
    are all scored (`full_t`). Scored positions are consecutive within one sequence (a scored t has t+1, t+2 in its
    segment), so a full window never crosses a segment; positions near a response's end have no full window and
    are left out (documented in docs/drafter.md)."""
    a_T = torch.where(mask_T, accept_T, torch.zeros_like(accept_T))
    full_T = mask_T.clone()
    total_T, running_T = torch.zeros_like(a_T), torch.ones_like(a_T)
    for k in range(window):
        running_T = running_T * _next(a_T, k, 0.0)
        total_T = total_T + running_T
        if k:
            full_T = full_T & _next(mask_T, k, False)
    return total_T, full_T


def draft_metrics(loss: Tensor, agree_T: Tensor, accept_T: Tensor, mask_T: Tensor, dp_size: int) -> Metrics:
    """The drafter's typed metrics of one pack (or one sequence); see docs/drafter.md."""
    length_T, full_T = expected_accept_len(accept_T, mask_T)
    return Metrics({
        "drafter/loss": Loss(loss.detach() / dp_size),
        "drafter/top1_agreement": Mean.of(agree_T, mask_T),
        "drafter/accept_prob": Mean.of(accept_T, mask_T),
        _LEN_KEY: Mean.of(length_T, full_T),
    })


def draft_loss(draft_hidden_TH: Tensor, draft_head_DH: Tensor, policy_hidden_TH: Tensor, teacher_head_DH: Tensor,
               mask_T: Tensor, *, norms: LossNormalizers, agg_mode: str, cu_seqlens: Tensor, temperature: float,
               chunk_size: int, teacher_bias_D: Optional[Tensor] = None) -> tuple[Tensor, Metrics]:
    """loss = agg_loss(ce_t, draft_mask, agg_mode) over one packed row, with the DRAFT loss's global normalisers.

    draft_hidden_TH: the drafter's final (normed) hidden states, row-aligned; draft_head_DH: its `lm_head.weight`.
    policy_hidden_TH: the policy's final hidden states `[T, H]`, row-aligned; position t's teacher is row t+1 (the
    shift happens here). teacher_head_DH / teacher_bias_D: the draft rows of the policy's output projection (and
    bias). Both teacher inputs are detached here, so the policy gets no gradient from this loss.
    mask_T: `draft_mask` of the row. norms: `count_draft_tokens_and_seqs` summed over the mini-batch and ranks, the
    run's dp_size and loss_scale_factor.

    Metrics: drafter/loss (LOSS, the agg value / dp_size); drafter/top1_agreement, drafter/accept_prob (MEAN over
    scored positions); drafter/expected_accept_len@3 (MEAN over scored positions with a full window).
    """
    check_mode(agg_mode)
    mask_T = mask_T.reshape(-1).bool()
    teacher_TH = _next(policy_hidden_TH.detach(), 1, 0.0)
    ce_T, agree_T, accept_T = chunked_soft_cross_entropy(
        draft_hidden_TH, draft_head_DH, teacher_TH, teacher_head_DH, temperature=temperature, chunk_size=chunk_size,
        teacher_bias_D=teacher_bias_D,
    )
    loss = agg_loss_with(ce_T, mask_T, agg_mode, norms, cu_seqlens=cu_seqlens)
    return loss, draft_metrics(loss, agree_T, accept_T, mask_T, norms.dp_size)


# ---- the per-sequence reference ------------------------------------------------------------------------------




def packed_draft_mask(packed: PackedRow, *, on: str) -> Tensor:
    """`draft_mask` of a pack's row, `[T]`."""
    return draft_mask(packed.label_mask[0], packed.response_mask[0], on=on)


def count_draft_tokens_and_seqs(packed: PackedRow, *, on: str) -> tuple[int, int]:
    """(scored draft positions, sequences with at least one) of one pack: what the train step all-reduces into the
    draft loss's own `LossNormalizers` (never the policy's: the masks differ)."""
    return count_tokens_and_seqs(packed_draft_mask(packed, on=on), packed.cu_seqlens)
