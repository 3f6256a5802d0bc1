"""The gradient scale of each aggregation mode relative to token-mean, and the warnings a user needs at start.

Relative to token-mean (every valid token weighs 1/N), with N valid tokens and S sequences in a mini-batch:
token-sum weighs every token 1 (scale N); seq-mean-token-sum 1/S (scale N/S, the mean length);
seq-mean-token-sum-norm 1/(S * factor) (scale N/(S * factor)); seq-mean-token-mean weighs a token of sequence i
1/(S * L_i), so it reweights sequences rather than scaling: its report gives the range of per-token weights
N/(S * L_i). The dp_size factor of `agg_loss` cancels FSDP2's mean over ranks and changes none of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fsdptrain.rl.aggregate import check_mode

LARGE_SCALE = 10.0  # a gradient this many times token-mean's is one a token-mean learning rate was not tuned for
FAR_FACTOR = 4.0  # a -norm factor this many times off the mean response length changes the scale that much


@dataclass(frozen=True)
class GradScaleReport:
    """`scale`: gradient relative to token-mean (None for seq-mean-token-mean, which reweights instead);
    `min_token_weight`/`max_token_weight`: per-token weight relative to token-mean's 1/N (equal to `scale` for
    modes that weigh all tokens alike); `warnings`: sentences for the user."""

    mode: str
    num_tokens: int
    num_seqs: int
    dp_size: int
    loss_scale_factor: float | None
    scale: float | None
    min_token_weight: float
    max_token_weight: float
    warnings: tuple[str, ...]

    def describe(self) -> str:
        """The normalisation in words, then the warnings."""
        n, s = self.num_tokens, self.num_seqs
        if self.mode == "token-mean":
            text = f"token-mean: the loss is the mean over all {n} valid tokens of the mini-batch (scale 1)."
        elif self.mode == "token-sum":
            text = f"token-sum: the loss is the sum over all {n} valid tokens; the gradient is {n}x token-mean's."
        elif self.mode == "seq-mean-token-sum":
            text = (
                f"seq-mean-token-sum: each sequence's token sum, averaged over {s} sequences; the gradient is "
                f"N/S = {self.scale:.4g}x token-mean's (the mean response length)."
            )
        elif self.mode == "seq-mean-token-sum-norm":
            text = (
                f"seq-mean-token-sum-norm: each sequence's token sum, averaged over {s} sequences and divided by "
                f"the constant {self.loss_scale_factor:g}; the gradient is N/(S x factor) = {self.scale:.4g}x "
                "token-mean's."
            )
        else:
            text = (
                f"seq-mean-token-mean: each sequence's token mean, averaged over {s} sequences; every sequence "
                "weighs the same, so a token of a short sequence weighs more: per-token weights range from "
                f"{self.min_token_weight:.4g}x to {self.max_token_weight:.4g}x token-mean's."
            )
        if self.dp_size > 1:
            text += (
                f" Each of the {self.dp_size} data-parallel ranks multiplies its loss by {self.dp_size} to cancel "
                "FSDP2's gradient mean, which leaves this scale unchanged."
            )
        return "\n".join([text, *("warning: " + w for w in self.warnings)])


def grad_scale_report(
    mode: str,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    seq_lengths: Sequence[int] | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    grad_clip: float | None = None,
) -> GradScaleReport:
    """Report for a mini-batch of `num_tokens` (N) valid tokens in `num_seqs` (S) sequences.

    `seq_lengths` (valid tokens per sequence; zeros are ignored) gives N and S when they are not passed and is
    needed for seq-mean-token-mean's weights. `grad_clip` None or <= 0 means clipping is off.
    """
    check_mode(mode)
    lengths = [int(x) for x in seq_lengths if x > 0] if seq_lengths is not None else None
    if num_tokens is None or num_seqs is None:
        if lengths is None:
            raise ValueError("pass num_tokens and num_seqs, or seq_lengths to count them from")
        num_tokens = sum(lengths) if num_tokens is None else num_tokens
        num_seqs = len(lengths) if num_seqs is None else num_seqs
    if num_tokens <= 0 or num_seqs <= 0:
        raise ValueError(f"need at least one valid token and sequence, got N={num_tokens}, S={num_seqs}")
    if mode == "seq-mean-token-sum-norm" and (loss_scale_factor is None or loss_scale_factor <= 0):
        raise ValueError("seq-mean-token-sum-norm needs loss_scale_factor > 0 (loss.loss_scale_factor)")
    if mode == "seq-mean-token-mean" and not lengths:
        raise ValueError("seq-mean-token-mean's report needs seq_lengths")

    mean_length = num_tokens / num_seqs
    clipping = grad_clip is not None and grad_clip > 0
    warnings: list[str] = []
    if mode == "seq-mean-token-mean":
        scale = None
        lo, hi = mean_length / max(lengths), mean_length / min(lengths)
    else:
        scale = {
            "token-mean": 1.0,
            "token-sum": float(num_tokens),
            "seq-mean-token-sum": mean_length,
            "seq-mean-token-sum-norm": mean_length / (loss_scale_factor or 1.0),
        }[mode]
        lo = hi = scale

    if mode == "token-sum":
        warnings.append(
            f"token-sum makes the gradient {num_tokens}x token-mean's and it grows with the batch's token count; "
            f"divide the learning rate by about {num_tokens} (or use token-mean)"
            + (", and the gradient clip will bind on almost every step" if clipping else ", and turn clipping on")
        )
    if mode == "seq-mean-token-sum-norm":
        ratio = loss_scale_factor / mean_length
        if ratio > FAR_FACTOR or ratio < 1.0 / FAR_FACTOR:
            warnings.append(
                f"loss_scale_factor {loss_scale_factor:g} is {ratio:.3g}x the mean response length "
                f"{mean_length:.4g}, so the gradient is {scale:.4g}x token-mean's; set it near the typical response "
                "length, or tune the learning rate for that scale"
            )
    if scale is not None and scale > LARGE_SCALE and mode != "token-sum":
        if clipping:
            warnings.append(
                f"the gradient is {scale:.4g}x token-mean's: a learning rate tuned for token-mean is {scale:.4g}x "
                f"too large, and the grad clip {grad_clip:g} will likely bind on most steps"
            )
        else:
            warnings.append(
                f"the gradient is {scale:.4g}x token-mean's and gradient clipping is off: lower the learning rate "
                "or set a grad clip"
            )
    return GradScaleReport(
        mode=mode,
        num_tokens=int(num_tokens),
        num_seqs=int(num_seqs),
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
        scale=scale,
        min_token_weight=lo,
        max_token_weight=hi,
        warnings=tuple(warnings),
    )
