"""Sequence packing: plan packs under a token budget, build packed rows, and undo them.

Legend: `_T` is the packed layout (one row of T tokens, `[1, T]` or `[T]`), `_BL` the padded layout `[B, L]`.

A pack is one row `[1, T]` holding several sequences back to back (docs/packing.md). Each sequence is
`prompt + response` token ids. Per-token tensors are aligned with the input:

    position t of a sequence holds, in `labels`, token t+1 of the SAME sequence;
    the last position of each sequence has no next token: its label is `label_fill` and it is masked;
    `response_positions[t]` is True when token t+1 is a response token, i.e. the log-prob computed at t scores it;
    `response_mask[t]` is True when token t+1 is a response token AND the policy's (its entry in the sequence's
    response mask is 1): the one mask the losses, their normalisers and every metric read (docs/packing.md).

So a sequence with prompt length P >= 1 and response length R has its R response tokens scored at its positions
P-1 .. P+R-2. A response mask (one 0/1 entry per response token, `fsdptrain.data.rollout_record.Rollout.response_mask`;
None = all ones) takes the tokens a tool, the environment or a chat separator wrote out of `response_mask` and
leaves `response_positions` as it is. A masked padding tail may follow the last sequence (`pad_to`); it is its own attention segment
(position ids restart at 0 there) so it can never see, or be seen by, a real sequence.

An empty pack (no sequences: a rank with less work runs one so every rank runs the same forwards) is a row of
`pad_to or 1` padding tokens, all masked: `num_seqs == 0`, `num_tokens == 0`, `cu_seqlens == [0]`.

This module is pure torch and never calls torch.distributed: the caller passes the agreed pack count.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Optional, Sequence

import torch

IGNORE_INDEX = -100
"""Default label at positions that score nothing (last token of a sequence, padding): HF's ignore index, so an
unmasked gather fails loudly instead of scoring a wrong token."""

TokenIds = Sequence[int] | torch.Tensor


# --------------------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackPlan:
    """Which sequences go into which pack.

    `packs[p]` lists indices into the planner's `lengths` (ascending), `pack_num_tokens[p]` their total length
    (at most `token_budget`), `fill_efficiency[p] = pack_num_tokens[p] / token_budget`. A pack may be empty when
    `min_packs` asks for more packs than the sequences need.
    """

    packs: list[list[int]]
    pack_num_tokens: list[int]
    fill_efficiency: list[float]
    token_budget: int

    @property
    def num_packs(self) -> int:
        return len(self.packs)


def plan_packs(lengths: Sequence[int], token_budget: int, *, min_packs: int = 1) -> PackPlan:
    """Fit sequences of the given lengths into packs of at most `token_budget` tokens, balanced.

    1. First-fit-decreasing fixes the pack count: max(FFD's count, `min_packs`).
    2. Balancing: while the fullest and the emptiest pack differ, move the one sequence from the fullest pack
       into the emptiest that brings the two closest, if that move narrows their gap and fits the budget.

    Guarantees (tested): every pack holds at most `token_budget` tokens; the largest and smallest pack differ by
    at most the longest sequence (while the gap is larger, any sequence of the fullest pack fits into the emptiest
    and narrows the gap, so step 2 cannot stop there); the pack count is exactly max(FFD's, `min_packs`); the
    same input gives the same plan (ties break by index).

    Raises ValueError for a sequence longer than the budget (naming its length and the budget), a length < 1, a
    budget < 1 or `min_packs` < 0.
    """
    lengths = [int(n) for n in lengths]
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if min_packs < 0:
        raise ValueError(f"min_packs must be >= 0, got {min_packs}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs at least one token")
        if n > token_budget:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the token budget of {token_budget}: raise the budget "
                f"(e.g. to the maximum prompt + response length) or truncate the sequence"
            )

    packs, loads = _first_fit_decreasing(lengths, token_budget)
    while len(packs) < min_packs:
        packs.append([])
        loads.append(0)
    _balance(packs, loads, lengths, token_budget)

    packs = [sorted(p) for p in packs]
    return PackPlan(
        packs=packs,
        pack_num_tokens=list(loads),
        fill_efficiency=[load / token_budget for load in loads],
        token_budget=token_budget,
    )


def _first_fit_decreasing(lengths: list[int], budget: int) -> tuple[list[list[int]], list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for p, load in enumerate(loads):
            if load + lengths[i] <= budget:
                packs[p].append(i)
                loads[p] += lengths[i]
                break
        else:
            packs.append([i])
            loads.append(lengths[i])
    return packs, loads


def _balance(packs: list[list[int]], loads: list[int], lengths: list[int], budget: int) -> None:
    """Move sequences from the fullest to the emptiest pack while that narrows their gap (in place).

    Each move strictly lowers the sum of squared loads, so the loop ends.
    """
    if len(packs) < 2:
        return
    while True:
        # ties: the lowest pack index, so the plan is deterministic
        hi = max(range(len(loads)), key=lambda p: (loads[p], -p))
        lo = min(range(len(loads)), key=lambda p: (loads[p], p))
        gap = loads[hi] - loads[lo]
        candidates = [i for i in packs[hi] if lengths[i] < gap and loads[lo] + lengths[i] <= budget]
        if not candidates:
            return
        best = min(candidates, key=lambda i: (abs(gap - 2 * lengths[i]), i))
        packs[hi].remove(best)
        packs[lo].append(best)
        loads[hi] -= lengths[best]
        loads[lo] += lengths[best]


# --------------------------------------------------------------------------------------------------------------
# Packed layout
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedBatch:
    """One packed row. Tensors are `[1, T]` unless said otherwise; T = `num_tokens` + padding tail.

    input_ids:        long, the sequences' tokens back to back, then `pad_token_id` in the tail.
    position_ids:     long, 0, 1, ... restarting at each sequence and at the start of the tail.
    cu_seqlens:       int32 `[num_seqs + 1]`, boundaries of the REAL sequences (the tail is not in it).
    labels:           long, token t+1 of the same sequence; `label_fill` at each sequence's last position and
                      in the tail.
    label_mask:       bool, True where `labels` holds a real next token (every position but each sequence's last
                      and the tail).
    response_positions: bool, True where the next token is a response token of any author (subset of
                      `label_mask`): where response-aligned values (`SeqTargets`) are placed.
    response_mask:    bool, True where the next token is a response token the policy sampled (subset of
                      `response_positions`): what the losses, their normalisers and every metric count.
    seq_index:        long, which sequence a position belongs to; the tail gets `num_seqs` (one past the last),
                      so a scatter into `num_seqs + 1` slots keeps it apart.
    prompt_lengths, response_lengths, seq_lengths: python ints per sequence, pack order.
    num_seqs, num_tokens: counts of real sequences and real tokens (tail excluded).
    max_seqlen:       the longest segment in the row, tail included (what varlen kernels take as max length).
    routes:           a mixture-of-experts policy's recorded routes on the row the MODEL runs (this row; a shared
                      pack's `model_row`), int16 `[L, T_model, k]`: the experts each MoE layer chose at generation
                      for each position, `OWN_ROUTE` (-1) where none was recorded (each sequence's last token, the
                      tail, a sequence without a record); None: no sequence carries routes (docs/moe.md).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    response_positions: torch.Tensor
    response_mask: torch.Tensor
    seq_index: torch.Tensor
    prompt_lengths: list[int]
    response_lengths: list[int]
    seq_lengths: list[int]
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    routes: Optional[torch.Tensor] = field(default=None, kw_only=True)

    @property
    def total_len(self) -> int:
        """T: the row's length including the padding tail."""
        return self.input_ids.shape[1]

    @property
    def num_pad_tokens(self) -> int:
        return self.total_len - self.num_tokens

    @property
    def num_response_tokens(self) -> int:
        """Response tokens of every author (the policy's and the tools'); the policy's: `response_mask.sum()`."""
        return sum(self.response_lengths)

    def segment_cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of every attention segment: the sequences, then the padding tail as one more segment.

        This is what attention kernels get: every position of the row belongs to some segment, so no kernel ever
        leaves the tail's output uninitialised.
        """
        if self.num_pad_tokens == 0:
            return self.cu_seqlens
        tail = torch.tensor([self.total_len], dtype=torch.int32, device=self.cu_seqlens.device)
        return torch.cat([self.cu_seqlens, tail])

    def to(self, device: torch.device | str) -> "PackedBatch":
        """A copy with every tensor on `device` (cu_seqlens too: varlen kernels want it beside the activations)."""
        moved = {
            f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return PackedBatch(**moved)


def _as_id_list(ids: TokenIds, what: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{what} must be 1-D token ids, got shape {tuple(ids.shape)}")
        return ids.tolist()
    return [int(t) for t in ids]


ResponseMask = Sequence[int] | torch.Tensor | None
"""One sequence's response mask: one 0/1 (or bool) entry per response token, 1 = the policy's; None = all ones."""


def _policy_flags(masks: Sequence[ResponseMask] | None, responses: list[list[int]]) -> list[list[bool]]:
    """Per sequence, per response token: True where the policy sampled it (all True without a mask)."""
    if masks is None:
        return [[True] * len(r) for r in responses]
    if len(masks) != len(responses):
        raise ValueError(f"got {len(masks)} response masks for {len(responses)} responses; pass one per response "
                         "(None for all ones)")
    out = []
    for i, (mask, r_ids) in enumerate(zip(masks, responses)):
        if mask is None:
            out.append([True] * len(r_ids))
            continue
        flags = [bool(m) for m in (mask.tolist() if isinstance(mask, torch.Tensor) else mask)]
        if len(flags) != len(r_ids):
            raise ValueError(f"response mask {i} has {len(flags)} entries for {len(r_ids)} response tokens; it needs "
                             "one 0/1 entry per response token")
        out.append(flags)
    return out


def _check_counts(prompts: Sequence, responses: Sequence, response_masks: Sequence | None) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; pass one response per prompt")
    if response_masks is not None and len(response_masks) != len(responses):
        raise ValueError(f"got {len(response_masks)} response masks for {len(responses)} responses; pass one per "
                         "response (None for all ones)")


def _check_pairs(prompts: Sequence[TokenIds], responses: Sequence[TokenIds]) -> list[tuple[list[int], list[int]]]:
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; pass one response per prompt")
    pairs = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        p_ids, r_ids = _as_id_list(p, f"prompt {i}"), _as_id_list(r, f"response {i}")
        if not p_ids:
            raise ValueError(
                f"prompt {i} is empty: the first response token is scored at the position before it, so every "
                f"sequence needs at least one prompt token (e.g. BOS)"
            )
        pairs.append((p_ids, r_ids))
    return pairs


def pack_sequences(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    indices: Sequence[int] | None = None,
    *,
    response_masks: Sequence[ResponseMask] | None = None,
    pad_to: int | None = None,
    pad_token_id: int = 0,
    label_fill: int = IGNORE_INDEX,
    routes: Sequence[Optional[torch.Tensor]] | None = None,
) -> PackedBatch:
    """Pack the sequences `prompts[i] + responses[i]` for i in `indices` (default: all, in order) into one row.

    `response_masks[i]`: the policy's response tokens of sequence i (None, or a None entry: all). `pad_to` fixes T
    (>= the real token count); the extra positions form a masked tail. With no sequence the row is an empty pack of
    `pad_to or 1` masked padding tokens. `routes`: `Rollout.routes` per sequence, laid out as `PackedBatch.routes`."""
    _check_counts(prompts, responses, response_masks)
    if indices is None:
        indices = range(len(prompts))
    chosen_prompts = [prompts[i] for i in indices]
    chosen_responses = [responses[i] for i in indices]
    pairs = _check_pairs(chosen_prompts, chosen_responses)
    policy = _policy_flags(response_masks and [response_masks[i] for i in indices], [r for _, r in pairs])

    prompt_lengths = [len(p) for p, _ in pairs]
    response_lengths = [len(r) for _, r in pairs]
    seq_lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    num_tokens = sum(seq_lengths)
    total_len = pad_to if pad_to is not None else max(num_tokens, 1)
    if total_len < max(num_tokens, 1):
        raise ValueError(f"pad_to={pad_to} is shorter than the pack's {num_tokens} tokens; raise pad_to or drop it")
    pad_len = total_len - num_tokens

    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    label_mask: list[bool] = []
    response_positions: list[bool] = []
    response_mask: list[bool] = []
    seq_index: list[int] = []
    for s, (p_ids, r_ids) in enumerate(pairs):
        ids = p_ids + r_ids
        n, num_prompt = len(ids), len(p_ids)
        input_ids += ids
        labels += ids[1:] + [label_fill]
        position_ids += range(n)
        label_mask += [True] * (n - 1) + [False]
        # position t scores token t+1; token t+1 is response token j = t+1-num_prompt when t+1 >= num_prompt
        response_positions += [False] * (num_prompt - 1) + [True] * len(r_ids) + [False]
        response_mask += [False] * (num_prompt - 1) + policy[s] + [False]
        seq_index += [s] * n
    input_ids += [pad_token_id] * pad_len
    labels += [label_fill] * pad_len
    position_ids += range(pad_len)
    for tail_mask in (label_mask, response_positions, response_mask):
        tail_mask += [False] * pad_len
    seq_index += [len(pairs)] * pad_len

    cu = [0, *accumulate(seq_lengths)]

    def row(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).view(1, total_len)

    return PackedBatch(
        input_ids=row(input_ids, torch.long),
        position_ids=row(position_ids, torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        labels=row(labels, torch.long),
        label_mask=row(label_mask, torch.bool),
        response_positions=row(response_positions, torch.bool),
        response_mask=row(response_mask, torch.bool),
        seq_index=row(seq_index, torch.long),
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        seq_lengths=seq_lengths,
        num_seqs=len(pairs),
        num_tokens=num_tokens,
        max_seqlen=max(seq_lengths + [pad_len]),
        routes=row_routes([routes[i] for i in indices] if routes is not None else [], cu[:-1], total_len),
    )


OWN_ROUTE = -1
"""A position of `PackedBatch.routes` with no recorded route (a sequence's last token, which no generating forward
read; the tail; a sequence without a record): a replaying router keeps its own choice there
(fsdptrain/model/moe.py)."""


def row_routes(records: Sequence[Optional[torch.Tensor]], starts: Sequence[int], total_len: int
               ) -> Optional[torch.Tensor]:
    """int16 `[L, total_len, k]`: each record `[L, n, k]` at its row position `starts[i]` onward, `OWN_ROUTE`
    elsewhere; None when no record is given."""
    given = [r for r in records if r is not None]
    if not given:
        return None
    out = torch.full((given[0].shape[0], total_len, given[0].shape[2]), OWN_ROUTE, dtype=torch.int16)
    for record, start in zip(records, starts):
        if record is not None:
            out[:, start:start + record.shape[1]] = record.to(torch.int16)
    return out


def _values_T(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Accept `[1, T, ...]` or `[T, ...]`; return `[T, ...]`."""
    total_len = packed.total_len
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == total_len:
        return values[0]
    if values.dim() >= 1 and values.shape[0] == total_len:
        return values
    raise ValueError(
        f"per-token values of shape {tuple(values.shape)} do not match the pack's row of {total_len} positions; "
        f"pass [1, T, ...] or [T, ...]"
    )


def unpack(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Split per-token values of the row (`[1, T, ...]` or `[T, ...]`) back per sequence: `[seq_lengths[i], ...]`.

    The inverse of the packing: `unpack(packed.input_ids, packed)[i]` is `prompts[i] + responses[i]`. The padding
    tail is dropped. Returns views (no copy); an empty pack gives an empty list.
    """
    values_T = _values_T(values, packed)
    return list(values_T[: packed.num_tokens].split(packed.seq_lengths)) if packed.num_seqs else []


def unpack_responses(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Per sequence, the values at the positions that score its response tokens: `[response_lengths[i], ...]`.

    Element j of sequence i is the value at its position P_i - 1 + j, the position that scores response token j
    (e.g. that token's log-prob), so the result is aligned with `responses[i]`. Returns views.
    """
    out = []
    for seq, num_prompt, num_response in zip(unpack(values, packed), packed.prompt_lengths, packed.response_lengths):
        out.append(seq[num_prompt - 1 : num_prompt - 1 + num_response])
    return out


# --------------------------------------------------------------------------------------------------------------
# Padded layout (the reference the packed layout is compared against)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded `[B, L]` layout of the same sequences, aligned exactly like `PackedBatch`.

    input_ids (long, `pad_token_id` after each sequence), attention_mask (long 1/0), position_ids (long, 0..L-1),
    labels (long, token t+1 of the row; `label_fill` at each row's last real position and in the padding),
    label_mask / response_positions / response_mask (bool, as in `PackedBatch`), and the per-sequence lengths.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    response_positions: torch.Tensor
    response_mask: torch.Tensor
    prompt_lengths: list[int]
    response_lengths: list[int]
    seq_lengths: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lengths)


def pad_sequences(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    *,
    response_masks: Sequence[ResponseMask] | None = None,
    pad_to: int | None = None,
    pad_token_id: int = 0,
    label_fill: int = IGNORE_INDEX,
) -> PaddedBatch:
    """Right-pad the sequences `prompts[i] + responses[i]` to L = `pad_to` or the longest length; `response_masks`
    as in `pack_sequences`."""
    pairs = _check_pairs(prompts, responses)
    if not pairs:
        raise ValueError("pad_sequences needs at least one sequence")
    policy = _policy_flags(response_masks, [r for _, r in pairs])
    seq_lengths = [len(p) + len(r) for p, r in pairs]
    width = pad_to if pad_to is not None else max(seq_lengths)
    if width < max(seq_lengths):
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sequence ({max(seq_lengths)} tokens)")

    batch = len(pairs)
    input_ids_BL = torch.full((batch, width), pad_token_id, dtype=torch.long)
    labels_BL = torch.full((batch, width), label_fill, dtype=torch.long)
    attention_mask_BL = torch.zeros((batch, width), dtype=torch.long)
    label_mask_BL = torch.zeros((batch, width), dtype=torch.bool)
    response_positions_BL = torch.zeros((batch, width), dtype=torch.bool)
    response_mask_BL = torch.zeros((batch, width), dtype=torch.bool)
    for b, (p_ids, r_ids) in enumerate(pairs):
        ids = torch.tensor(p_ids + r_ids, dtype=torch.long)
        n = len(ids)
        input_ids_BL[b, :n] = ids
        labels_BL[b, : n - 1] = ids[1:]
        attention_mask_BL[b, :n] = 1
        label_mask_BL[b, : n - 1] = True
        response_positions_BL[b, len(p_ids) - 1 : n - 1] = True
        response_mask_BL[b, len(p_ids) - 1 : n - 1] = torch.tensor(policy[b], dtype=torch.bool)
    return PaddedBatch(
        input_ids=input_ids_BL,
        attention_mask=attention_mask_BL,
        position_ids=torch.arange(width).expand(batch, width).clone(),
        labels=labels_BL,
        label_mask=label_mask_BL,
        response_positions=response_positions_BL,
        response_mask=response_mask_BL,
        prompt_lengths=[len(p) for p, _ in pairs],
        response_lengths=[len(r) for _, r in pairs],
        seq_lengths=seq_lengths,
    )
