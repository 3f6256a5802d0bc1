"""Packs whose sequences share their prompt: the model sees each prompt once, then every response to it
(`trainer.share_prompts`, docs/packing.md "Shared prompts").

Legend: `_T` the loss row (`pack_sequences`' layout: every sequence's prompt + response), `_M` the model row (each
distinct prompt once), `_K` keys gathered for the varlen kernels.

A GRPO group is n samples of one prompt. `pack_sequences` lays each sample out as prompt + response, so a pack
holding the group runs every projection and MLP on the prompt n times. The model row of a shared pack holds, per
distinct prompt of the pack (a *group*, in order of first appearance):

    [prompt][response 1][response 2] ... [response n]

- position ids: 0 .. P-1 over the prompt; response i continues at P, P+1, ... (as in its own sequence);
- attention (:class:`PromptBranches`): a prompt token sees the prompt causally; a token of response i sees the whole
  prompt and response i causally, never another response;
- so every position of the model row computes exactly the hidden state of the same token in its own unshared sequence
  (up to rounding: the attention's sums run over the same keys in another order).

The loss row is `pack_sequences`' row of the same sequences, unchanged, so the losses, their normalisers and every
metric read what they read without sharing. `source_T` maps each loss-row position to the model-row position holding
the same token in the same context: ``hidden_T = hidden_M[source_T]`` (fsdptrain/model/forward.py). The log-prob of
a response's first token is read at the prompt's last position, so one hidden state feeds n scored positions: the
gather hands it to each (no token is duplicated), and the gather's backward sums their gradients, which is the sum
the unshared row forms over its n copies of the prompt. Every other prompt position's gradient is likewise the sum
over the responses that attend to it.

Planning (:func:`shared_prompt_units`): a group is packed as one unit of P + sum(R_i) tokens, split into several units
(each repeating the prompt) where it would exceed the token budget, so a pack holds whole groups where it can.

Pure torch, no torch.distributed: the caller agrees the pack count (fsdptrain/distributed/collectives.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.data.packing import (
    IGNORE_INDEX,
    PackedBatch,
    PackPlan,
    ResponseMask,
    TokenIds,
    pack_sequences,
    row_routes,
)


@dataclass(frozen=True)
class PromptBranches:
    """The attention of a model row with shared prompts, read by the packed attention backends
    (fsdptrain/model/attention_backends.py) from the `prompt_branches` keyword of the model's forward.

    masks:  per segment of the model row (each group; `cu_seqlens` of :class:`SharedPromptRow`), bool `[L, L]`: key j
            is visible from query t when j <= t and j is a prompt token or in t's response; None for a segment that
            is plainly causal (a group with one response).
    cu_q, cu_k, kv_index_K, max_q, max_k: the same attention as varlen entries, one per prompt and one per
            non-empty response, in row order: entry e's queries are the row positions `cu_q[e] .. cu_q[e+1]`, its
            keys the row positions `kv_index_K[cu_k[e] .. cu_k[e+1]]` (a response entry: its prompt, then itself),
            causal aligned to the bottom-right corner (flash-attention's convention when queries are fewer than keys).
    """

    masks: tuple[Optional[Tensor], ...]
    cu_q: Tensor
    cu_k: Tensor
    kv_index_K: Tensor
    max_q: int
    max_k: int

    def to(self, device: torch.device | str) -> "PromptBranches":
        return PromptBranches(tuple(None if m is None else m.to(device) for m in self.masks), self.cu_q.to(device),
                              self.cu_k.to(device), self.kv_index_K.to(device), self.max_q, self.max_k)


@dataclass(frozen=True)
class SharedPromptRow:
    """The model's input row of a shared pack: tensors `[1, T_M]`, `cu_seqlens` int32 (one segment per group),
    `max_seqlen` (the longest group), `branches` (the attention within each group), and `source_T` (long `[T]`, for
    each position of the loss row, the model-row position whose hidden state it takes)."""

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    branches: PromptBranches
    source_T: Tensor

    @property
    def total_len(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> "SharedPromptRow":
        return SharedPromptRow(self.input_ids.to(device), self.position_ids.to(device), self.cu_seqlens.to(device),
                               self.max_seqlen, self.branches.to(device), self.source_T.to(device))


@dataclass(frozen=True)
class SharedPromptPack(PackedBatch):
    """A pack whose model forward runs on `model_row` (each prompt once); every other field is the loss row, exactly
    `pack_sequences`' of the same sequences."""

    model_row: SharedPromptRow

    def to(self, device: torch.device | str) -> "SharedPromptPack":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {name: (v.to(device) if isinstance(v, (Tensor, SharedPromptRow)) else v) for name, v in moved.items()}
        return SharedPromptPack(**moved)


def _groups(prompts: list[list[int]]) -> list[list[int]]:
    """Indices into `prompts` grouped by equal prompt, groups in order of first appearance, members in order."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    return list(by_prompt.values())


def _ids(ids: TokenIds) -> list[int]:
    return ids.tolist() if isinstance(ids, Tensor) else [int(t) for t in ids]


def shared_prompt_units(prompts: Sequence[TokenIds], responses: Sequence[TokenIds], token_budget: int
                        ) -> tuple[list[list[int]], list[int]]:
    """The planning units of shared packing: `(members, num_tokens)` per unit.

    A unit is sequences of one prompt (indices, ascending) whose shared layout P + sum(R_i) fits `token_budget`; a
    group is cut into consecutive units where it would not. Every sequence must fit the budget on its own (P + R <=
    budget; `fsdptrain.distributed.collectives.plan_agreed_shared` checks that first).
    """
    prompt_ids = [_ids(p) for p in prompts]
    units, sizes = [], []
    for group in _groups(prompt_ids):
        num_prompt = len(prompt_ids[group[0]])
        current, size = [], num_prompt
        for i in group:
            num_response = len(_ids(responses[i]))
            if current and size + num_response > token_budget:
                units.append(current)
                sizes.append(size)
                current, size = [], num_prompt
            current.append(i)
            size += num_response
        units.append(current)
        sizes.append(size)
    return units, sizes


def expand_units(plan: PackPlan, units: list[list[int]]) -> PackPlan:
    """A plan over units turned into the plan over their sequences (each pack's indices ascending)."""
    packs = [sorted(i for u in pack for i in units[u]) for pack in plan.packs]
    return PackPlan(packs=packs, pack_num_tokens=plan.pack_num_tokens, fill_efficiency=plan.fill_efficiency,
                    token_budget=plan.token_budget)


def pack_shared_prompts(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    indices: Sequence[int] | None = None,
    *,
    response_masks: Sequence[ResponseMask] | None = None,
    pad_token_id: int = 0,
    label_fill: int = IGNORE_INDEX,
    routes: Sequence[Optional[Tensor]] | None = None,
) -> PackedBatch:
    """`pack_sequences(prompts, responses, indices, ...)` as the loss row, with the model row that holds each
    distinct prompt of the pack once (layout: the module docstring). An empty pack is `pack_sequences`' own.
    `routes` (`pack_sequences`') are laid out on the model row: a prompt's from the first of its sequences that
    carries a record (at generation a group's prompt is read once, but its last token once per sample: where two
    samples' routes of it differ, the first's is replayed; docs/moe.md "Routing replay")."""
    loss_row = pack_sequences(prompts, responses, indices, response_masks=response_masks,
                              pad_token_id=pad_token_id, label_fill=label_fill)
    if loss_row.num_seqs == 0:
        return loss_row
    chosen = list(range(len(prompts))) if indices is None else list(indices)
    chosen_prompts = [_ids(prompts[i]) for i in chosen]
    chosen_responses = [_ids(responses[i]) for i in chosen]
    loss_starts = [0, *torch.tensor(loss_row.seq_lengths).cumsum(0).tolist()]

    input_ids: list[int] = []
    position_ids: list[int] = []
    source_T = torch.empty(loss_row.num_tokens, dtype=torch.long)
    cu, masks = [0], []
    cu_q, cu_k, kv_index = [0], [0], []
    pieces: list[tuple[Optional[Tensor], int]] = []  # (a record's positions, where they go on the model row)
    chosen_routes = [routes[i] for i in chosen] if routes is not None else [None] * len(chosen)
    for group in _groups(chosen_prompts):
        prompt = chosen_prompts[group[0]]
        num_prompt, start = len(prompt), len(input_ids)
        prompt_range = list(range(start, start + num_prompt))
        input_ids += prompt
        position_ids += range(num_prompt)
        cu_q.append(cu_q[-1] + num_prompt)
        cu_k.append(cu_k[-1] + num_prompt)
        kv_index += prompt_range
        branch = [0] * num_prompt
        recorded = next((chosen_routes[s] for s in group if chosen_routes[s] is not None), None)
        pieces.append((None if recorded is None else recorded[:, :num_prompt], start))
        for number, s in enumerate(group, start=1):
            response = chosen_responses[s]
            response_start = len(input_ids)
            own_record = chosen_routes[s]
            pieces.append((None if own_record is None else own_record[:, num_prompt:], response_start))
            input_ids += response
            position_ids += range(num_prompt, num_prompt + len(response))
            branch += [number] * len(response)
            own = torch.arange(response_start, response_start + len(response))
            source_T[loss_starts[s]: loss_starts[s + 1]] = torch.cat([torch.tensor(prompt_range), own])
            if response:
                cu_q.append(cu_q[-1] + len(response))
                cu_k.append(cu_k[-1] + num_prompt + len(response))
                kv_index += prompt_range + own.tolist()
        cu.append(len(input_ids))
        masks.append(_branch_mask(branch))

    total = len(input_ids)
    row_cu = torch.tensor(cu, dtype=torch.int32)
    q_cu, k_cu = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    model_row = SharedPromptRow(
        input_ids=torch.tensor(input_ids, dtype=torch.long).view(1, total),
        position_ids=torch.tensor(position_ids, dtype=torch.long).view(1, total),
        cu_seqlens=row_cu,
        max_seqlen=int(row_cu.diff().max()),
        branches=PromptBranches(masks=tuple(masks), cu_q=q_cu, cu_k=k_cu,
                                kv_index_K=torch.tensor(kv_index, dtype=torch.long),
                                max_q=int(q_cu.diff().max()), max_k=int(k_cu.diff().max())),
        source_T=source_T,
    )
    return SharedPromptPack(**{f.name: getattr(loss_row, f.name) for f in fields(loss_row) if f.name != "routes"},
                            model_row=model_row, routes=row_routes([p for p, _ in pieces], [s for _, s in pieces], total))


def _branch_mask(branch: list[int]) -> Optional[Tensor]:
    """bool `[L, L]` of one group: causal, and a response token sees only the prompt (branch 0) and its own
    response; None when the group has at most one response (plain causal)."""
    if len(set(branch) - {0}) <= 1:
        return None
    branch_L = torch.tensor(branch)
    same_or_prompt = (branch_L[None, :] == 0) | (branch_L[None, :] == branch_L[:, None])
    return torch.ones(len(branch), len(branch), dtype=torch.bool).tril() & same_or_prompt
