"""The supervised fine-tuning loss: the negative log-likelihood of the demonstrated tokens (docs/sft.md).

Legend: `_T` per-token tensors of one packed row `[T]` (position t scores token t+1 of the same sequence) or a padded
`[B, T]` batch; `cu_seqlens` says which (see `fsdptrain.rl.aggregate`).
"""

from __future__ import annotations

from torch import Tensor

from fsdptrain.rl.aggregate import LossNormalizers, SeqLayout, agg_loss_with, check_mode, masked
from fsdptrain.metrics.typed import Loss, Mean, Metrics


def sft_loss(logprobs_T: Tensor, mask_T: Tensor, *, norms: LossNormalizers, agg_mode: str,
             cu_seqlens: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """loss = agg_loss(-log p(token), mask, agg_mode) with the mini-batch's global normalisers `norms`.

    `logprobs_T`: the log-prob of each next token at temperature 1; `mask_T`: nonzero where that token is
    trained on (the demonstration's `response_mask`: the assistant's tokens). Under token-mean (the default) the
    loss is the sum of the trained tokens' negative log-likelihood over this micro-batch divided by the global
    count N of trained tokens, times dp_size (`agg_loss`), so summing micro-batches and FSDP's mean over ranks give
    the whole mini-batch's mean NLL per trained token. Masked positions get exactly zero gradient, NaN included.

    Metrics: loss (LOSS: the agg value / dp_size); nll (MEAN: the NLL per trained token, pooled over tokens, equal
    to loss under token-mean); num_tokens (MEAN's count is the trained tokens).
    """
    check_mode(agg_mode)
    layout = SeqLayout(logprobs_T.shape, cu_seqlens, logprobs_T.device)
    valid = layout.valid(mask_T)
    nll_T = masked(-logprobs_T, valid)
    loss = agg_loss_with(nll_T, valid, agg_mode, norms, cu_seqlens=cu_seqlens)
    return loss, Metrics({"loss": Loss(loss / norms.dp_size), "nll": Mean.of(nll_T, valid)})
