"""Loss aggregation: one global scalar per mini-batch, whatever the packing, micro-batching and dp layout.

Legend: `_BT` padded `[B, T]` (a row is a sequence), `_T` packed `[T]` (a segment of `cu_seqlens` is a sequence).

`agg_loss` is the one place where the data-parallel factor is applied. FSDP2's reduce-scatter averages gradients
over the dp ranks; every rank's micro-batch loss is divided by the *global* count of the mode and multiplied by
`dp_size`, so that summing micro-batch losses on a rank and averaging over ranks gives exactly the whole-batch
scalar (docs/loss.md).

Departures from verl 0.9.1's `agg_loss` (values otherwise identical in the padded layout):
- the mask is a boolean selection (nonzero = valid), applied with `torch.where`, so NaN/inf at masked positions never
  reach the value or the gradient; verl multiplies by the mask (NaN * 0 = NaN);
- a zero denominator (nothing valid in the whole batch) gives a zero loss instead of NaN;
- seq-mean-token-mean divides by the exact token count of a sequence (verl adds 1e-8, below fp32 resolution);
- the packed layout (`cu_seqlens`) is ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.moe_aux_loss import MoeNormalizers

_NEEDS_TOKENS = ("token-mean",)


def check_mode(mode: str) -> None:
    """Raise a ValueError naming the valid modes when `mode` is not one of `AGG_MODES`."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


class SeqLayout:
    """Which sequence every token belongs to, for the padded and the packed layout alike.

    Padded `[B, T]`: row b is sequence b. Packed `[T]` or `[1, T]` with `cu_seqlens` (int, `[n+1]`, starting at 0):
    tokens `cu_seqlens[i]:cu_seqlens[i+1]` are sequence i; tokens at or after `cu_seqlens[-1]` are a padding tail
    that belongs to no sequence and is always treated as masked. Building the layout reads shapes only (no
    device-to-host copy), so it is cheap on a GPU.
    """

    def __init__(self, token_shape: torch.Size, cu_seqlens: Tensor | None, device: torch.device):
        self.token_shape = token_shape
        self.packed = cu_seqlens is not None
        if not self.packed:
            if len(token_shape) != 2:
                raise ValueError(
                    f"padded layout needs [B, T] tensors, got shape {tuple(token_shape)}; "
                    "for a packed row pass cu_seqlens"
                )
            self.num_seqs = token_shape[0]
            return
        if len(token_shape) == 2 and token_shape[0] != 1:
            raise ValueError(
                f"packed layout needs [T] or [1, T] tensors, got shape {tuple(token_shape)}; "
                "drop cu_seqlens for a padded [B, T] batch"
            )
        if len(token_shape) not in (1, 2):
            raise ValueError(f"packed layout needs [T] or [1, T] tensors, got shape {tuple(token_shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D [n+1] starting at 0, got shape {tuple(cu_seqlens.shape)}")
        self.num_seqs = cu_seqlens.numel() - 1
        num_tokens = token_shape[-1]
        cu = cu_seqlens.to(device=device)
        positions = torch.arange(num_tokens, device=device, dtype=cu.dtype)
        # Index i for tokens of segment i; index n (one past the last sequence) for the padding tail.
        self.seq_index_T = torch.searchsorted(cu[1:].contiguous(), positions, right=True)
        self.in_seq_T = self.seq_index_T < self.num_seqs

    def valid(self, mask: Tensor) -> Tensor:
        """Boolean mask of the tokens that count: nonzero in `mask` and, when packed, inside a sequence."""
        valid = mask.reshape(self.token_shape) != 0
        if self.packed:
            valid = valid & self.in_seq_T.reshape(self.token_shape)
        return valid

    def seq_sum(self, x: Tensor) -> Tensor:
        """Per-sequence sum `[n]` of a token tensor (already zero where not valid)."""
        if not self.packed:
            return x.sum(dim=-1)
        out = torch.zeros(self.num_seqs + 1, dtype=x.dtype, device=x.device)
        return out.index_add(0, self.seq_index_T, x.reshape(-1))[: self.num_seqs]

    def broadcast(self, per_seq: Tensor) -> Tensor:
        """Token tensor (the layout's shape) holding each sequence's value; 0 on the padding tail."""
        if not self.packed:
            return per_seq.unsqueeze(-1).expand(self.token_shape)
        padded = torch.cat([per_seq, per_seq.new_zeros(1)])
        return padded[self.seq_index_T].reshape(self.token_shape)


def masked(x: Tensor, valid: Tensor) -> Tensor:
    """`x` where valid, exact 0 elsewhere; gradients at invalid positions are exactly 0 even if `x` is NaN there."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    dp_size: int = 1,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Aggregate per-token losses of one micro-batch into its share of the mini-batch scalar.

    Shapes: padded `loss_mat`/`loss_mask` `[B, T]` (a row is a sequence), or packed `[T]`/`[1, T]` with
    `cu_seqlens` `[n+1]` (a segment is a sequence; a tail after `cu_seqlens[-1]` is ignored). `loss_mask` is a
    selection: nonzero means valid. Let `s_i` be the masked token sum of sequence i, `c_i` its valid token count,
    N the global token count and S the global count of sequences with at least one valid token:

    - token-mean:              sum_i s_i / N * dp_size
    - token-sum:               sum_i s_i * dp_size
    - seq-mean-token-sum:      sum_i s_i / S * dp_size
    - seq-mean-token-sum-norm: sum_i s_i / S / loss_scale_factor * dp_size
    - seq-mean-token-mean:     sum_{i: c_i > 0} (s_i / c_i) / S * dp_size

    Sequences with no valid token count for nothing. `global_num_tokens` (N) and `global_num_seqs` (S) default to
    this call's own counts, and `loss_scale_factor` to the padded width; those defaults exist for parity with
    verl's function only and are refused where they would be wrong (dp_size > 1; -norm in the packed layout).
    A zero N or S (nothing valid anywhere) gives 0.
    """
    check_mode(mode)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    layout = SeqLayout(loss_mat.shape, cu_seqlens, loss_mat.device)
    valid = layout.valid(loss_mask)
    # Reduce in at least fp32: a bf16 count or sum of many tokens would round.
    loss = masked(loss_mat, valid).to(torch.promote_types(loss_mat.dtype, torch.float32))

    if mode == "token-sum":
        return loss.sum() * dp_size
    if mode in _NEEDS_TOKENS:
        if global_num_tokens is None:
            if dp_size > 1:
                raise ValueError("global_num_tokens is required when dp_size > 1 (pass the mini-batch's token count)")
            global_num_tokens = valid.sum()
        return loss.sum() / _at_least_one(global_num_tokens, loss) * dp_size

    seq_count = layout.seq_sum(valid.to(torch.int64))
    if global_num_seqs is None:
        if dp_size > 1:
            raise ValueError(
                f"global_num_seqs is required for {mode} when dp_size > 1 (pass the mini-batch's sequence count)"
            )
        global_num_seqs = (seq_count > 0).sum()
    seq_loss = layout.seq_sum(loss)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_loss / seq_count.clamp(min=1)  # a sequence with c_i = 0 has s_i = 0: it adds nothing
    total = seq_loss.sum() / _at_least_one(global_num_seqs, loss) * dp_size
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            if layout.packed:
                raise ValueError(
                    "seq-mean-token-sum-norm needs an explicit loss_scale_factor in the packed layout "
                    "(set loss.loss_scale_factor, e.g. the maximum response length)"
                )
            loss_scale_factor = loss_mat.shape[-1]
        if loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        total = total / loss_scale_factor
    return total


def _at_least_one(count: int | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


@dataclass(frozen=True)
class LossNormalizers:
    """The global counts of one mini-batch, built once by the trainer before its micro-batches run.

    `global_num_tokens`: valid tokens over all ranks and micro-batches; `global_num_seqs`: sequences with at least
    one valid token; `dp_size`: data-parallel ranks (dp_replicate x dp_shard); `loss_scale_factor`: the
    constant of seq-mean-token-sum-norm (None: only allowed in the padded layout, where the width is used); `moe`: an
    MoE policy's load-balancing counts (`fsdptrain.rl.moe_aux_loss.MoeNormalizers`), None for a dense model.
    """

    global_num_tokens: int
    global_num_seqs: int
    dp_size: int = 1
    loss_scale_factor: float | None = None
    moe: MoeNormalizers | None = None

    def __post_init__(self):
        if self.global_num_tokens < 0 or self.global_num_seqs < 0:
            raise ValueError(f"global counts must be >= 0, got {self.global_num_tokens}, {self.global_num_seqs}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor}")


def count_tokens_and_seqs(loss_mask: Tensor, cu_seqlens: Tensor | None = None) -> tuple[int, int]:
    """This batch's (valid tokens, sequences with a valid token): what the trainer all-reduces into normalizers."""
    layout = SeqLayout(loss_mask.shape, cu_seqlens, loss_mask.device)
    valid = layout.valid(loss_mask)
    seq_count = layout.seq_sum(valid.to(torch.int64))
    return int(valid.sum().item()), int((seq_count > 0).sum().item())


def agg_loss_with(
    loss_mat: Tensor, loss_mask: Tensor, mode: str, norms: LossNormalizers, *, cu_seqlens: Tensor | None = None
) -> Tensor:
    """`agg_loss` with every count taken from `norms` (the trainer's path)."""
    return agg_loss(
        loss_mat,
        loss_mask,
        mode,
        dp_size=norms.dp_size,
        global_num_tokens=norms.global_num_tokens,
        global_num_seqs=norms.global_num_seqs,
        loss_scale_factor=norms.loss_scale_factor,
        cu_seqlens=cu_seqlens,
    )
