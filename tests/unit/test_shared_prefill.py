"""A GRPO group's repeated prompt is run through the model once (fsdptrain/generation/generate.py
`shared_prompt_cache`), and the tokens generated are the ones the unshared path gives, sampled and greedy, with
prompts of different lengths (left padding)."""

from __future__ import annotations

import torch

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.generate import generate_responses
from tests.helpers.tiny_llama import tiny_llama

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 9, 9, 9, 5]]


def test_shared_prefill_generates_the_same_tokens_with_one_prefill_per_prompt():
    tokenizer = load_bundled_tokenizer()
    model = tiny_llama(len(tokenizer), num_hidden_layers=2, num_key_value_heads=2).eval()
    batch = [p for p in PROMPTS for _ in range(4)]
    widths = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kwargs: widths.append(tuple(kwargs["input_ids"].shape)),
                                             with_kwargs=True)
    for sample in (True, False):
        kwargs = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, do_sample=sample, generator_seed=3,
                      device=torch.device("cpu"))
        widths.clear()
        shared = generate_responses(model, tokenizer, batch, share_prompt_prefill=True, **kwargs)
        assert widths[:2] == [(3, 5), (12, 1)]  # 3 distinct prompts but their last token, then 12 last tokens
        widths.clear()
        assert shared == generate_responses(model, tokenizer, batch, **kwargs)
        assert widths[0] == (12, 6)  # unshared: the whole prompt of every copy
    handle.remove()
    assert [prompt for prompt, _, _ in shared] == batch
