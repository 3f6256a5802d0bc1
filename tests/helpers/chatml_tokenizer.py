"""A character-level tokenizer with a ChatML chat template that renders tools, written here (nothing downloads), for
the multi-turn tests: one token per printable ASCII character or newline, plus ChatML's special tokens. EOS is
``<|im_end|>``, as in Qwen's instruct tokenizers; the template groups consecutive tool messages in one user turn of
``<tool_response>`` blocks, as Qwen2.5's does."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = ["\n", *[chr(c) for c in range(32, 127)]]

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with tools (a trimmed Qwen2.5 shape): the tools' JSON schemas in a system turn, tool results in user
turns."""

CHATML_NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

STRIPS_THINK = CHATML_TOOLS.replace(
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}",
    "{% elif m.role == 'assistant' and not loop.last %}<|im_start|>assistant\n"
    "{{ m.content.split('</think>')[-1].lstrip() }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}")
"""A template that rewrites history: earlier assistant turns lose their <think> block (as Qwen3's does)."""


def chatml_tokenizer(chat_template: str = CHATML_TOOLS, extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The tokenizer (pad 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2 = EOS, unk 3, then the characters); ``extra_tokens``
    are added as ordinary (non-special) added tokens, e.g. a whole tool call as one token for scripted tests."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<unk>", padding_side="left")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    fast.chat_template = chat_template
    return fast
