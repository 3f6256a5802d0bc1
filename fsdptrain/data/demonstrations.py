"""Demonstrations for ``fsdptrain sft``: rows of local files as token ids and the mask of the tokens trained on
(docs/sft.md).

A row is a chat (the ``sft.messages_key`` column: a list of messages, tool calls and tool messages included, with an
optional ``sft.tools_key`` column of tool schemas) or a prompt and a completion (``data.prompt_key`` and
``sft.completion_key``: strings, or messages). Files are read as prompt files are (fsdptrain/data/prompt_files.py:
JSONL/JSON/Parquet/CSV or a ``save_to_disk`` folder, never a download).

A chat becomes ids through :func:`fsdptrain.data.conversation.chat_response`, the token-in/token-out rendering of
multi-turn rollouts: the prompt is what a rollout starts from, the assistant's turns are trained on (mask 1) and
everything else (system, user and tool messages, the template's separators) is not (mask 0), built by the same
function that grows a rollout's ``response_mask``. A string prompt and completion are the tokenizer's ids of the
prompt (special tokens added, as for a string prompt of data.source=prompts) and of the completion followed by EOS,
the whole completion trained on.

Every mistake is one line naming the file, the 0-based row and the fix (ConfigError): a row that is neither shape,
a chat with no assistant message, a template that fails on or drops a message's role, a row longer than
``trainer.token_budget`` (a sequence is never split over micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import chat_response, extend_response, render_text
from fsdptrain.data.prompt_files import read_table
from fsdptrain.registry.errors import first_line


@dataclass(frozen=True)
class DemoKeys:
    """Which columns hold a row's parts (``sft.*_key``, ``data.prompt_key``)."""

    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    tools: str = "tools"


@dataclass(frozen=True)
class Demonstration:
    """One row as a sequence: ``index`` over the whole source, the prompt's ids, the response's ids and its mask
    (1: trained on)."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def load_demonstrations(source, *, tokenizer, keys: DemoKeys, token_budget: int, what: str = "data.path",
                        max_positions: int | None = None) -> list[Demonstration]:
    """Every row of ``source`` as a :class:`Demonstration`, in file order; ConfigError (one line) on a bad row, a
    row over ``token_budget`` or past the model's ``max_positions`` (None: no limit)."""
    demos: list[Demonstration] = []
    for part in read_table(source, what=what):
        names = list(part.table.column_names)
        for local, record in enumerate(part.table):
            where = f"{part.label}: row {local} (0-based)"
            try:
                prompt_ids, response_ids, mask = demonstration_ids(record, names, tokenizer=tokenizer, keys=keys)
            except ValueError as err:
                raise ConfigError(f"{where}: {err}") from None
            demo = Demonstration(len(demos), prompt_ids, response_ids, mask)
            if demo.num_tokens > token_budget:
                raise ConfigError(f"{where} is {demo.num_tokens} tokens, more than trainer.token_budget="
                                  f"{token_budget} (a sequence is never split): raise trainer.token_budget or "
                                  "shorten the row")
            if max_positions is not None and demo.num_tokens > max_positions:
                raise ConfigError(f"{where} is {demo.num_tokens} tokens, past the model's max_position_embeddings="
                                  f"{max_positions}: shorten the row, or raise max_position_embeddings in the "
                                  "model's config where its RoPE scaling makes longer positions valid")
            demos.append(demo)
    return demos


def demonstration_ids(record: dict, names: Sequence[str], *, tokenizer, keys: DemoKeys
                      ) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, response_ids, response_mask)`` of one row; ValueError naming what is wrong."""
    if keys.messages in names and record.get(keys.messages) is not None:
        tools = record.get(keys.tools) if keys.tools in names else None
        return chat_ids(_messages(record[keys.messages], keys.messages), tokenizer=tokenizer, tools=tools)
    if keys.prompt not in names or keys.completion not in names:
        raise ValueError(f"expected a column {keys.messages!r} (sft.messages_key) or the columns {keys.prompt!r} "
                         f"(data.prompt_key) and {keys.completion!r} (sft.completion_key); columns are {list(names)}")
    prompt, completion = record[keys.prompt], record[keys.completion]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise ValueError(f"empty {keys.completion!r}, so nothing would be trained on")
        prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        response_ids, mask = [], []
        completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        extend_response(response_ids, mask, [*completion_ids, tokenizer.eos_token_id], trained=True)
        return prompt_ids, response_ids, mask
    for column, value in ((keys.prompt, prompt), (keys.completion, completion)):
        if not isinstance(value, (str, list)):
            raise ValueError(f"column {column!r}: expected a string or a non-empty list of {{role, content}} "
                             f"messages, got {type(value).__name__} {_shown(value)}")
    if isinstance(prompt, str):
        raise ValueError(f"column {keys.prompt!r} is a string but {keys.completion!r} is a list of messages: give "
                         "both as strings or the prompt as messages too")
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    return chat_ids(_messages(prompt, keys.prompt) + _messages(completion, keys.completion), tokenizer=tokenizer,
                    tools=None)


def chat_ids(messages: list[dict], *, tokenizer, tools: Optional[list]) -> tuple[list[int], list[int], list[int]]:
    """A chat through the tokenizer's chat template (:func:`chat_response`), after checking the template renders
    every message (each one added changes the rendering): one that raises, or drops a message, is a ValueError
    naming the role."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the row is a chat but the tokenizer has no chat template; use a model folder whose "
                         "tokenizer has one, or prompt and completion strings")
    previous = None
    for end in range(1, len(messages) + 1):
        try:
            text = render_text(tokenizer, messages[:end], tools=tools, add_generation_prompt=False)
        except Exception as err:  # the template's own raise_exception(), or a role it does not handle
            roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
            raise ValueError(f"the tokenizer's chat template cannot render this chat (roles {roles}): "
                             f"{type(err).__name__}: {first_line(err)}") from None
        if text == previous:
            role = messages[end - 1]["role"]
            raise ValueError(f"the tokenizer's chat template drops its {role!r} message {end - 1} (rendering it "
                             f"changes nothing), so it cannot be trained as written; use a template that renders "
                             f"the role {role!r}")
        previous = text
    return chat_response(tokenizer, messages, tools=tools)


def _messages(value, column: str) -> list[dict]:
    """A column's chat as plain dicts (a Parquet struct's missing fields, None, dropped; ``content`` kept)."""
    if not (isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                      for m in value)):
        raise ValueError(f"column {column!r}: expected a non-empty list of {{role, content}} messages, got "
                         f"{type(value).__name__} {_shown(value)}")
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in value]


def _shown(value) -> str:
    """``repr(value)`` cut at 60 characters, for an error line."""
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''}"
