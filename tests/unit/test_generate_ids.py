"""generate_responses takes prompt texts or token id lists: the same ids give the same (sampled) responses."""

from __future__ import annotations

import torch

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.generation.generate import generate_responses
from tests.helpers.tiny_llama import tiny_llama


def test_token_id_prompts_generate_what_the_same_texts_generate():
    tokenizer = load_bundled_tokenizer()
    model = tiny_llama(len(tokenizer), attn_implementation="sdpa")
    texts = ["repeat 7 =", "copy 3 1 4 =", "repeat 2 ="]  # different lengths: left padding differs per row
    ids = [tokenizer(t)["input_ids"] for t in texts]
    common = dict(max_new_tokens=5, temperature=1.0, top_p=1.0, do_sample=True, generator_seed=11,
                  device=torch.device("cpu"))
    from_texts = generate_responses(model, tokenizer, texts, **common)
    from_ids = generate_responses(model, tokenizer, ids, **common)
    assert from_ids == from_texts
    assert [prompt for prompt, _, _ in from_ids] == ids
