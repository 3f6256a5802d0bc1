"""Shared-prefix attention: the prompt a group's rows share (a GRPO group) held once, not copied into every row of
the continuous engine's batch (fsdptrain/generation/continuous.py).

The live groups' prompt caches are stacked once each (:class:`PrefixStack`), and the engine runs the model on its own
attention function (``SHARED_PREFIX_ATTENTION``, registered with transformers' AttentionInterface and
AttentionMaskInterface; sdpa in any forward without prefixes) that takes one softmax over [prefix ; own keys]
(:class:`SharedPrefixes`): a decode step reads each prefix once, batched over its rows; a prefill copies each row's
prefix next to its own keys for sdpa, ``PREFILL_CHUNK_VALUES`` values at a time. :class:`FusedAttention` is the
attention of a forward that decodes the live rows and prefills the entering ones at once. Models whose attention is
not plain (sliding windows, soft-capping, sinks) or not dispatched through the interface keep a copy of the prefix in
every row (:func:`can_share_prefixes`), as does a prompt shorter than ``SHARED_PREFIX_MIN_TOKENS``.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from fsdptrain.generation.kv_cache import KeptCache

SHARED_PREFIX_MIN_TOKENS = 16
"""A group's prompt is held once only from this many cached tokens (a cache block) up: a shorter one is copied into
each of its rows, whose few columns cost less than the shared-prefix attention's fixed cost per forward (the default
tiny task's 3-token prefixes: 12.3 ms a 64-row rollout shared, 10.1 ms copied, one thread; docs/rollout.md)."""
PREFILL_CHUNK_VALUES = 1 << 16
"""A prefill onto shared prefixes copies each row's prefix keys and values for its attention, this many values
(rows x (prefix + own columns) x kv heads x head_dim) at a time, one layer at a time."""
SHARED_PREFIX_ATTENTION = "fsdptrain_shared_prefix"
"""The attention the engine runs the model on: sdpa, except in a forward given ``shared_prefixes``."""


def can_share_prefixes(model) -> bool:
    """Whether a group's prompt cache can be held once (attention over [shared prefix ; own tokens]): the model's
    attention goes through transformers' AttentionInterface and is plain softmax attention over every earlier
    position (no sliding-window layer, no logit soft-capping, no attention sinks). Otherwise each row holds its own
    copy of its group's prompt cache, as before."""
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        return False
    config = model.config.get_text_config()
    plain = all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
    return (plain and getattr(config, "attn_logit_softcapping", None) is None
            and not any(hasattr(m, "sinks") for m in model.modules()))


def register_shared_prefix_attention() -> None:
    if SHARED_PREFIX_ATTENTION not in AttentionInterface():
        AttentionInterface.register(SHARED_PREFIX_ATTENTION, shared_prefix_attention)
        AttentionMaskInterface.register(SHARED_PREFIX_ATTENTION, sdpa_mask)


def shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            shared_prefixes: Optional["SharedPrefixes"] = None, **kwargs):
    """transformers' attention interface: sdpa over the cache's keys, or (``shared_prefixes`` given) one softmax
    over each row's shared prefix and its own keys."""
    if shared_prefixes is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return shared_prefixes.attend(module.layer_idx, query, key, value, attention_mask,
                                  query.shape[-1] ** -0.5 if scaling is None else scaling), None


class PrefixStack:
    """Distinct shared prefixes, one copy each: per layer keys and values [kv heads, prefixes, width, dim] (the
    layout the decode step's matmul batches over), prefix g in columns [0, its length) (``valid``)."""

    def __init__(self, prefixes: list[KeptCache]):
        self.ids = {id(p) for p in prefixes}
        self.index = {id(p): g for g, p in enumerate(prefixes)}
        width = max(p.length for p in prefixes)
        ref = prefixes[0].layers[0][0]
        self.layers = []
        for layer in range(len(prefixes[0].layers)):
            pair = []
            for part in range(2):
                stacked = ref.new_zeros(ref.shape[0], len(prefixes), width, ref.shape[2])
                for g, p in enumerate(prefixes):
                    stacked[:, g, :p.length] = p.layers[layer][part]
                pair.append(stacked)
            self.layers.append(pair)
        lengths = torch.tensor([p.length for p in prefixes], device=ref.device)
        self.valid = torch.arange(width, device=ref.device) < lengths[:, None]
        self.num_positions = len(prefixes) * width


class SharedPrefixes:
    """One forward's rows and their prefixes in the stack. Attention for a row (``attend``): one softmax over
    [its prefix's keys ; its own keys]. The prefix part is one matmul batched over (kv head, prefix), each prefix's
    rows gathered into its slots [kv heads, prefixes, slots x queries, dim]: the prefix is read once per forward and
    never copied per row. The own part is a batched matmul over the rows' own keys. A row without a prefix takes a
    slot of prefix 0 with every prefix column masked, so its prefix part is exactly zero."""

    def __init__(self, stack: PrefixStack, prefixes: list[Optional[KeptCache]]):
        self.stack, self.num_calls = stack, 0
        groups = [stack.index[id(p)] if p is not None else -1 for p in prefixes]
        members: dict[int, int] = {}
        slot_of_row = []
        for g in groups:
            g = max(g, 0)
            slot_of_row.append((g, members.get(g, 0)))
            members[g] = members.get(g, 0) + 1
        self.num_groups, self.per_group = stack.valid.shape[0], max(members.values())
        slots = [g * self.per_group + j for g, j in slot_of_row]
        row_of_slot = [0] * (self.num_groups * self.per_group)  # an empty slot reads row 0: its result is never read
        for row, slot in enumerate(slots):
            row_of_slot[slot] = row
        device = stack.valid.device
        self.slot, self.row_of_slot = torch.tensor(slots, device=device), torch.tensor(row_of_slot, device=device)
        self.groups = torch.tensor(groups, device=device)
        self.visible = stack.valid[self.groups.clamp(min=0)] & (self.groups >= 0)[:, None]  # [rows, width]
        self._bias: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (own mask, its additive bias)

    def _bias_for(self, mask: torch.Tensor, dtype) -> torch.Tensor:
        """[rows, 1, 1, width + own]: 0 where a row sees the key, -inf elsewhere (the same for every layer)."""
        if self._bias is None or self._bias[0] is not mask:
            visible = torch.cat([self.visible[:, None, None, :], mask.expand(len(self.visible), 1, 1, -1)], dim=-1)
            bias = torch.zeros(visible.shape, dtype=dtype, device=mask.device).masked_fill_(~visible, float("-inf"))
            self._bias = (mask, bias)
        return self._bias[1]

    def attend(self, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        """``query`` [rows, heads, q, dim], the rows' own ``key``/``value`` [rows, kv heads, own, dim], ``mask``
        over the own keys (transformers' bool [rows, 1, q, own], or None: every key visible, causal when q == own).
        Returns [rows, q, heads, dim] as transformers' attention functions do."""
        self.num_calls += 1
        num_rows, heads, q_len, dim = query.shape
        kv_heads, own = key.shape[1], key.shape[2]
        if mask is None:  # transformers leaves it out when every key is visible (causal when q == own)
            mask = torch.ones(q_len, own, dtype=torch.bool, device=query.device).tril(own - q_len)[None, None]
        if q_len > 1:
            return self._attend_gathered(layer, query, key, value, mask.bool(), scaling)
        n = heads // kv_heads  # query head h reads kv head h // n
        keys, values = self.stack.layers[layer]
        width, grouped = keys.shape[2], (kv_heads, self.num_groups, self.per_group * n, dim)
        q = query.reshape(num_rows, kv_heads, n, dim) * scaling
        in_slots = q.transpose(0, 1).index_select(1, self.row_of_slot).view(grouped)
        scores_prefix = (in_slots @ keys.transpose(-1, -2)).view(kv_heads, -1, n, width).index_select(1, self.slot)
        scores = torch.cat([scores_prefix.transpose(0, 1), q @ key.transpose(-1, -2)], dim=-1)
        probs = torch.softmax(scores + self._bias_for(mask.bool(), scores.dtype), dim=-1)
        out = probs[..., width:] @ value
        probs_in_slots = probs[..., :width].transpose(0, 1).index_select(1, self.row_of_slot).view(
            kv_heads, self.num_groups, self.per_group * n, width)
        from_prefix = (probs_in_slots @ values).view(kv_heads, -1, n, dim).index_select(1, self.slot)
        out = out + from_prefix.transpose(0, 1)
        return out.view(num_rows, heads, 1, dim).transpose(1, 2).contiguous()

    def _attend_gathered(self, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        """A prefill (several queries a row, rare): sdpa over [prefix ; own keys] with each row's prefix copied
        to it, a chunk of rows at a time (``PREFILL_CHUNK_VALUES``), so the copies stay small and transient."""
        keys, values = self.stack.layers[layer]
        num_rows, kv_heads, own, dim = key.shape
        chunk = max(1, PREFILL_CHUNK_VALUES // ((keys.shape[2] + own) * kv_heads * dim))
        mask = mask.expand(num_rows, 1, *mask.shape[2:])
        out = []
        for start in range(0, num_rows, chunk):
            rows = slice(start, start + chunk)
            group = self.groups[rows].clamp(min=0)
            k = torch.cat([keys[:, group].transpose(0, 1), key[rows]], dim=2)
            v = torch.cat([values[:, group].transpose(0, 1), value[rows]], dim=2)
            m = torch.cat([self.visible[rows, None, None, :].expand(-1, 1, mask.shape[2], -1), mask[rows]], dim=-1)
            out.append(torch.nn.functional.scaled_dot_product_attention(
                query[rows], k, v, attn_mask=m, scale=scaling, enable_gqa=query.shape[1] != kv_heads))
        return torch.cat(out).transpose(1, 2).contiguous()


class FusedAttention:
    """The attention of a fused decode-and-prefill forward: queries packed [1, heads, tokens, dim], each live row's
    one token first, then each entering row's new tokens. The live rows' queries attend as a decode step
    (``live``, :meth:`SharedPrefixes.attend`), the entering rows' as a prefill (``entering``: left-padded to the
    longest, a pad query reading its row's first real token and that token's keys, its output dropped), over the
    batch's keys ``mask`` [rows, columns] shows (each entering row causally up to its own column). Returns [1,
    tokens, heads, dim]."""

    def __init__(self, live: "SharedPrefixes", entering: "SharedPrefixes", mask: torch.Tensor,
                 new_len: list[int]):
        self.live, self.entering, self.num_calls = live, entering, 0
        self.num_live, self.longest = mask.shape[0] - len(new_len), max(new_len)
        device, width, longest = mask.device, mask.shape[1], self.longest
        starts = itertools.accumulate(new_len, initial=self.num_live)
        self.query_index = torch.tensor([start + max(i - (longest - n), 0) for start, n in zip(starts, new_len)
                                         for i in range(longest)], device=device)
        self.out_index = torch.tensor([e * longest + longest - n + j for e, n in enumerate(new_len)
                                       for j in range(n)], device=device)
        visible = mask.bool()
        self.live_mask = visible[:self.num_live, None, None, :]
        last_column = torch.tensor([[width - longest + max(i, longest - n) for i in range(longest)]
                                    for n in new_len], device=device)  # [entering, longest]
        causal = torch.arange(width, device=device) <= last_column[:, :, None]
        self.entering_mask = visible[self.num_live:, None, None, :] & causal[:, None]  # [entering, 1, longest, width]
        self.mask_placeholder = visible[:1, None, None, :1]  # a 4D mask: transformers hands it on as it is

    def attend(self, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        self.num_calls += 1
        live, heads, dim = self.num_live, query.shape[1], query.shape[3]
        packed = query[0]  # [heads, tokens, dim]
        out_live = self.live.attend(layer, packed[:, :live].transpose(0, 1)[:, :, None], key[:live], value[:live],
                                    self.live_mask, scaling)  # [live, 1, heads, dim]
        entering = packed.index_select(1, self.query_index).view(heads, -1, self.longest, dim).transpose(0, 1)
        out_entering = self.entering.attend(layer, entering, key[live:], value[live:], self.entering_mask, scaling)
        out_entering = out_entering.reshape(-1, heads, dim).index_select(0, self.out_index)
        return torch.cat([out_live[:, 0], out_entering])[None]
