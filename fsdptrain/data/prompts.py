"""Prompt datasets: rows read from local files, rendered to text, filtered by length, split (the order
they are visited in: fsdptrain/data/epoch_order.py).

A row is a :class:`PromptRow`: its 0-based index over the whole source (files in the order given), the prompt text
given to the tokenizer, and every other column of the row, which travels with it to the reward functions. The prompt
column holds a string (used as is) or a chat: a list of ``{"role": ..., "content": ...}`` messages, rendered with the
tokenizer's chat template and the generation prompt appended. Row numbers in errors are 0-based positions within the
named file (what ``Dataset[i]`` returns), and the message says so.

Departures from TRL: no on-the-fly "conversational" detection per batch (a row is a chat or a string, decided at
load), and prompts longer than ``max_prompt_length`` are dropped (or an error), never truncated from the left.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.registry.errors import first_line
from fsdptrain.data.prompt_files import read_table

RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")
"""Keyword arguments every reward function receives; a dataset column with one of these names would clash."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt: ``index`` is its 0-based row over the whole source, ``columns`` every other column's value."""

    index: int
    text: str
    columns: dict
    is_chat: bool = False
    messages: Optional[list] = None
    """The chat's ``{role, content}`` messages (None for a string prompt); multi-turn rollouts render them again
    with the tools."""

    def chat(self) -> list[dict]:
        """The prompt as messages: the chat's, or one user message holding a string prompt."""
        return [dict(m) for m in self.messages] if self.messages is not None else [{"role": "user", "content": self.text}]


def load_prompts(source: str | Sequence[str], *, tokenizer, prompt_key: str = "prompt",
                 what: str = "data.path") -> list[PromptRow]:
    """Every row of ``source`` (see :mod:`fsdptrain.data.prompt_files`) as a :class:`PromptRow`, in file order.

    Raises ConfigError naming the file, the 0-based row and the column for: a missing prompt column, a column named
    like a reward argument, a prompt that is neither a non-empty string nor a chat, or a chat when the tokenizer has
    no chat template.
    """
    rows: list[PromptRow] = []
    for part in read_table(source, what=what):
        names = list(part.table.column_names)
        if prompt_key not in names:
            raise ConfigError(f"{part.label}: no column {prompt_key!r} (data.prompt_key); columns are {names}")
        clash = [c for c in names if c in RESERVED_COLUMNS]
        if clash:
            raise ConfigError(f"{part.label}: column {clash[0]!r} clashes with the reward function argument of "
                              f"that name; rename it")
        for local, record in enumerate(part.table):
            where = f"{part.label}: row {local} (0-based), column {prompt_key!r}"
            text, is_chat = render_prompt(record[prompt_key], tokenizer=tokenizer, where=where)
            columns = {k: v for k, v in record.items() if k != prompt_key}
            messages = [{"role": m["role"], "content": m["content"]} for m in record[prompt_key]] if is_chat else None
            rows.append(PromptRow(index=len(rows), text=text, columns=columns, is_chat=is_chat, messages=messages))
    return rows


def render_prompt(value, *, tokenizer, where: str) -> tuple[str, bool]:
    """``(text, is_chat)`` for one prompt cell: a string as is, a chat through the tokenizer's chat template."""
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: empty prompt")
        return value, False
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{where}: the prompt is a chat but the tokenizer has no chat template; give plain "
                              f"string prompts or a tokenizer with a chat_template")
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
        except Exception as err:  # the template's own raise_exception(), or a role it does not handle
            roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
            raise ConfigError(f"{where}: the tokenizer's chat template fails on this chat (roles {roles}): "
                              f"{type(err).__name__}: {first_line(err)}") from None
    raise ConfigError(f"{where}: expected a string or a chat (a non-empty list of {{role, content}} messages with "
                      f"string values), got {_describe(value)}")


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def prompt_token_ids(tokenizer, row: PromptRow) -> list[int]:
    """The ids generation starts from: special tokens added for a plain prompt, none for a rendered chat (its template
    already wrote them)."""
    return list(tokenizer(row.text, add_special_tokens=not row.is_chat)["input_ids"])


def drop_long_prompts(rows: Sequence[PromptRow], *, tokenizer, max_prompt_length: int | None,
                      long_prompts: str = "skip", label: str = "data.path", max_positions: int | None = None,
                      max_new_tokens: int = 0) -> tuple[list[PromptRow], int]:
    """The rows whose prompt fits, and how many were dropped: at most ``max_prompt_length`` tokens
    (:func:`prompt_token_ids`; None: any length), and with ``max_new_tokens`` sampled after it within the model's
    ``max_positions`` (None: no limit; RoPE past a model's positions computes angles it was never trained at).

    ``long_prompts='error'`` raises ConfigError naming the first long row and the limit instead. A source whose rows
    are all too long is an error either way.
    """
    if long_prompts not in ("skip", "error"):
        raise ConfigError(f"data.long_prompts={long_prompts!r} is not a valid choice; choose one of: skip, error")
    if max_prompt_length is None and max_positions is None:
        return list(rows), 0
    kept = []
    for row in rows:
        length = len(prompt_token_ids(tokenizer, row))
        why = _too_long(length, max_prompt_length, max_positions, max_new_tokens)
        if why is None:
            kept.append(row)
        elif long_prompts == "error":
            raise ConfigError(f"{label}: row {row.index} (0-based, over all files) has {length} prompt tokens, {why} "
                              "(or set data.long_prompts=skip)")
    if not kept:
        limits = [f"data.max_prompt_length={max_prompt_length}"] if max_prompt_length is not None else []
        if max_positions is not None:
            limits.append(f"the model's max_position_embeddings={max_positions} less rollout.max_new_tokens="
                          f"{max_new_tokens}")
        raise ConfigError(f"{label}: every prompt is longer than {' and '.join(limits)} allow")
    return kept, len(rows) - len(kept)


def _too_long(length: int, max_prompt_length: int | None, max_positions: int | None, max_new_tokens: int
              ) -> str | None:
    """Why a prompt of ``length`` tokens is too long (the limit it passes and the setting that moves it), or None."""
    if max_prompt_length is not None and length > max_prompt_length:
        return f"more than data.max_prompt_length={max_prompt_length}"
    if max_positions is not None and length + max_new_tokens > max_positions:
        return (f"which with rollout.max_new_tokens={max_new_tokens} reach position {length + max_new_tokens}, past "
                f"the model's max_position_embeddings={max_positions} (lower rollout.max_new_tokens, or raise "
                "max_position_embeddings in the model's config where its RoPE scaling makes longer positions valid)")
    return None


def hold_out_eval(rows: Sequence[PromptRow], *, eval_size: int, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """``(train, eval)``: ``eval_size`` rows drawn with ``seed`` and never trained on; both keep file order.

    The draw depends only on the number of rows, ``eval_size`` and ``seed``. Hold out before filtering by length,
    so the split does not move when ``max_prompt_length`` changes.
    """
    if eval_size < 0 or eval_size >= len(rows):
        raise ConfigError(f"data.num_eval_prompts={eval_size} must be in [0, {len(rows)}) for a dataset of {len(rows)} "
                          f"rows (at least one row must remain to train on)")
    held = set(random.Random(f"eval:{seed}").sample(range(len(rows)), eval_size))
    train = [r for i, r in enumerate(rows) if i not in held]
    evals = [r for i, r in enumerate(rows) if i in held]
    return train, evals
