"""Tiny reward-model folders for tests: Llama / Qwen2 `*ForSequenceClassification` (num_labels=1) saved with
save_pretrained, with a character-level tokenizer that differs from the policy's bundled word-level one."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from fsdptrain.data.tokenizer import load_bundled_tokenizer
from fsdptrain.model.loading import TINY_CONFIG

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 =:+-,?")
CHAT_TEMPLATE = "{% for m in messages %}{{ '<' + m['role'][0] + '>' + m['content'] }}{% endfor %}"
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character (pad 0, bos 1, eos 2, unk 3, then CHARS from 4); BOS prepended; optional `<u>`/`<a>`
    role tokens (44, 45) and a chat template that writes `<u>prompt<a>completion`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")
    if chat_template is not None:
        fast.add_special_tokens({"additional_special_tokens": ["<u>", "<a>"]})
        fast.chat_template = chat_template
    return fast


def model_config(arch: str, *, vocab_size: int, num_labels: int = 1, **overrides):
    fields = {**SMALL, "vocab_size": vocab_size, "num_labels": num_labels, "pad_token_id": 0, **overrides}
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**fields)


def save_reward_model(folder: Path, *, arch: str = "llama", tokenizer=None, num_labels: int = 1, seed: int = 0,
                      causal: bool = False, config=None) -> Path:
    """Save a random tiny model and `tokenizer` (default: the character-level one) into `folder`.

    The score head is drawn with std 0.3 (transformers draws 0.02), so scores are O(1) and a 1e-5 tolerance means
    something."""
    tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
    config = config if config is not None else model_config(arch, vocab_size=len(tokenizer), num_labels=num_labels)
    torch.manual_seed(seed)
    if causal:
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = AutoModelForSequenceClassification.from_config(config)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_policy_shaped_reward_model(folder: Path, *, seed: int = 0) -> Path:
    """A Llama reward model with the tiny policy's config (fsdptrain.models.TINY_CONFIG) and the bundled tokenizer:
    the one a critic can start from."""
    fields = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    config = LlamaConfig(**fields, num_labels=1, pad_token_id=0)
    return save_reward_model(folder, tokenizer=load_bundled_tokenizer(), config=config, seed=seed)


def save_seven_reward_model(folder: Path) -> Path:
    """A Llama reward model whose score is known: 1 when the text's last character is "7", else 0 (to ~1e-5).

    Every decoder layer's output projections are zero, so the residual stream at each position is the token's
    embedding: e1 for every token, e0 + e1 for "7". The final RMSNorm maps e0 + e1 to 4 (e0 + e1) (mean square 2/32)
    and e1 to sqrt(32) e1; the score head reads e0 / 4. Without a chat template the text is prompt + completion, so
    the last token is the completion's last character (the prompt's when the completion is empty)."""
    tokenizer = char_tokenizer()
    config = model_config("llama", vocab_size=len(tokenizer))
    model = AutoModelForSequenceClassification.from_config(config)
    seven = tokenizer.convert_tokens_to_ids("7")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 1] = 1.0
        embed[seven, 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[0, 0] = 0.25
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
