"""The drafter one sequence at a time: each sequence alone through the unpacked policy and drafter, the full teacher
logits sliced to the draft vocabulary, a plain softmax soft cross-entropy (docs/drafter.md)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.rl.aggregate import LossNormalizers, agg_loss_with
from fsdptrain.rl.draft_loss import draft_metrics, soft_cross_entropy_from_logits
from fsdptrain.metrics.typed import Metrics, merge_all


def sequence_draft_mask(num_prompt: int, num_tokens: int, on: str, response_mask=None) -> Tensor:
    """bool `[n]`: position t scores token t+2 when it exists and, with ``on="response"``, is a response token the
    policy sampled (response token j = t+2-num_prompt with ``response_mask[j]`` set; None: every one)."""
    t = torch.arange(num_tokens)
    ok = t + 2 < num_tokens
    if on != "response":
        return ok
    policy = [True] * (num_tokens - num_prompt) if response_mask is None else [bool(m) for m in response_mask]
    return torch.tensor([bool(k) and 0 <= i + 2 - num_prompt < len(policy) and policy[i + 2 - num_prompt]
                         for i, k in enumerate(ok.tolist())], dtype=torch.bool)


def reference_draft_outputs(policy, drafter, prompt_ids: Sequence[int], response_ids: Sequence[int], *,
                            temperature: float) -> tuple[Tensor, Tensor]:
    """One sequence alone, unfused: (draft logits `[n, D]`, teacher logits `[n, D]`), both / temperature, row t of
    both scoring token t+2 (rows whose t+2 does not exist hold the teacher of the last row; they are masked).

    The policy runs unpacked on sdpa and returns every hidden state (`output_hidden_states`: entry i is the input of
    decoder layer i, the convention of `drafter.feature_layers`); its FULL logits are sliced to the draft columns.
    The drafter runs on sdpa over the sequence alone, with the next token's embedding (zero at the last position).
    `drafter` needs: `feature_layers`, `draft_to_target`, `attention(name)`, `forward(features, embeds,
    position_ids=...)`, `compute_logits(hidden)`.
    """
    device = next(policy.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=device)
    num_tokens = ids.shape[1]
    with torch.no_grad(), generation_attention(policy):
        out = policy(input_ids=ids, use_cache=False, output_hidden_states=True)
        embeds_nH = policy.get_input_embeddings()(ids)[0]
    features_nK = torch.cat([out.hidden_states[i][0] for i in drafter.feature_layers], dim=-1)
    next_embeds_nH = torch.cat([embeds_nH[1:], embeds_nH.new_zeros(1, embeds_nH.shape[-1])])
    columns = drafter.draft_to_target.to(device)
    teacher_nD = out.logits[0][:, columns].float() / temperature
    teacher_nD = torch.cat([teacher_nD[1:], teacher_nD[-1:]])
    position_ids = torch.arange(num_tokens, device=device)[None]
    with drafter.attention("sdpa"):
        hidden_nH = drafter(features_nK, next_embeds_nH, position_ids=position_ids)
    draft_nD = drafter.compute_logits(hidden_nH).float() / temperature
    return draft_nD, teacher_nD


def per_sequence_draft_loss(policy, drafter, prompts, responses, *, norms: LossNormalizers, agg_mode: str, on: str,
                            temperature: float, response_masks=None) -> tuple[Tensor, Metrics]:
    """The oracle: each sequence alone (`reference_draft_outputs`), plain softmax soft CE, `agg_loss` of its `[1, n]`
    row with the mini-batch's global draft normalisers, summed over sequences; metrics merged. ``response_masks``:
    per sequence the policy's response tokens (None: all)."""
    total: Optional[Tensor] = None
    collected = []
    masks = response_masks if response_masks is not None else [None] * len(prompts)
    for prompt_ids, response_ids, response_mask in zip(prompts, responses, masks):
        draft_nD, teacher_nD = reference_draft_outputs(policy, drafter, prompt_ids, response_ids,
                                                       temperature=temperature)
        mask_n = sequence_draft_mask(len(prompt_ids), draft_nD.shape[0], on, response_mask).to(draft_nD.device)
        ce_n, agree_n, accept_n = soft_cross_entropy_from_logits(draft_nD, teacher_nD)
        loss = agg_loss_with(ce_n[None], mask_n[None], agg_mode, norms)
        total = loss if total is None else total + loss
        collected.append(draft_metrics(loss, agree_n, accept_n, mask_n, norms.dp_size))
    assert total is not None, "the reference needs at least one sequence"
    return total, merge_all(collected)
