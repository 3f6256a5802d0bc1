"""Rollouts: the policy generates responses to a step's prompts; the task's verifier rewards them as text.

A :class:`Rollout` is one sequence: prompt ids, response ids, a reward in [0, 1], its prompt group's global index and
whether it was truncated. Generation runs on transformers' ``generate`` with sdpa attention, a KV cache, left padding
and an attention mask (never through the packed training backends: a per-segment causal kernel with one query against
a cache attends to key 0 only). ``generate`` turns on synced GPUs for FSDP-wrapped models, so ranks whose sequences
stop at different lengths keep stepping together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class Rollout:
    """One sequence of experience; ids exclude padding, the response ends with EOS unless it was truncated."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    group: int
    truncated: bool = False
    behaviour_logprobs: Optional[list[float]] = None
    prompt_text: str = ""
    response_text: str = ""
    extra: dict = field(default_factory=dict)


def split_response(generated: Sequence[int], *, eos_id: int) -> tuple[list[int], bool]:
    """The response up to and including the first EOS, and whether it hit the length limit instead (truncated).

    ``generated`` holds the new tokens only; what follows the first EOS is ``generate``'s padding of a finished row
    and is dropped. A row with no EOS ran to the limit: every token was sampled (a sampled pad id included) and kept.
    """
    out: list[int] = []
    for token in generated:
        out.append(int(token))
        if token == eos_id:
            return out, False
    return out, True


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    do_sample: bool,
    generator_seed: int,
    device: torch.device,
) -> list[tuple[list[int], list[int], bool]]:
    """Generate one response per prompt text: ``(prompt_ids, response_ids, truncated)`` for each, in order.

    Sampling draws from torch's global RNG, seeded here from ``generator_seed`` so a step's rollouts are reproducible
    (and the same on resume); greedy decoding (``do_sample=False``) is used for evaluation.
    """
    was_training = model.training
    model.eval()
    torch.manual_seed(generator_seed)
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    input_ids = enc["input_ids"].to(device)
    attention_mask = enc["attention_mask"].to(device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if do_sample else dict(do_sample=False)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **sampling,
    )
    model.train(was_training)
    prompt_width = input_ids.shape[1]
    results = []
    for row in range(len(prompts)):
        prompt_ids = input_ids[row][attention_mask[row].bool()].tolist()
        response_ids, truncated = split_response(
            out[row, prompt_width:].tolist(), eos_id=tokenizer.eos_token_id
        )
        results.append((prompt_ids, response_ids, truncated))
    return results
