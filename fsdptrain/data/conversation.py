"""Token-in/token-out chat rendering: a tokenizer's chat template as ids (``render_text`` / ``render_ids``), the
template checks multi-turn relies on, the ids that follow an assistant turn with tool messages, and parsing a turn's
tool calls (:class:`ChatTurns`). The one place this rendering lives (docs/architecture.md); the turn loop that uses it
is fsdptrain/rollout/turns.py.

Because the template is checked to be prefix-preserving (on a dummy conversation, at start-up), ids built turn by turn
from :meth:`ChatTurns.prompt` and :meth:`ChatTurns.tool_segment_ids` equal the template's rendering of the final
conversation, token for token, up to the separator the template writes after the final EOS.

Tool calls are parsed from each turn's sampled ids: with the tokenizer's own response parsing
(``tokenizer.parse_response``) when it has a ``response_template``, else the common
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of the decoded text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fsdptrain.config import ConfigError

TOOL_CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

_DUMMY_TOOL = {"type": "function", "function": {"name": "fsdptrain_probe", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


def render_text(tokenizer, messages: Sequence[dict], *, tools: Optional[Sequence[dict]],
                add_generation_prompt: bool) -> str:
    """``messages`` as the chat template writes them with ``tools``."""
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def render_ids(tokenizer, messages: Sequence[dict], *, tools: Optional[Sequence[dict]],
               add_generation_prompt: bool) -> list[int]:
    """The ids of :func:`render_text` (the template writes its own special tokens, so none are added)."""
    text = render_text(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def extend_response(response_ids: list[int], response_mask: list[int], ids: Sequence[int], *, trained: bool) -> None:
    """Append ``ids`` to a response and to its mask: 1 (``trained``) where the policy wrote them, 0 where the
    template, a user or a tool did. The one place a response mask grows: multi-turn rollouts
    (fsdptrain/rollout/turns.py) and SFT's demonstrations (:func:`chat_response`) both build theirs here."""
    response_ids.extend(ids)
    response_mask.extend([1 if trained else 0] * len(ids))


def chat_response(tokenizer, messages: Sequence[dict], *, tools: Optional[Sequence[dict]]
                  ) -> tuple[list[int], list[int], list[int]]:
    """A whole chat as a trajectory: ``(prompt_ids, response_ids, response_mask)``.

    The prompt is everything before the first assistant message, with the generation prompt: the ids a multi-turn
    rollout starts from (:meth:`ChatTurns.prompt`). Each assistant turn adds its ids up to and including its EOS with
    mask 1, as a sampled turn is; what the template writes between two assistant turns (its separator after the EOS,
    the user's or the tools' messages, the next generation prompt) is added with mask 0, as a rollout's tool segment
    is. Messages after the last assistant turn are not part of it. Built from the template's renderings of the
    conversation's own prefixes, so the ids equal the rendering of the whole chat token for token (up to the
    separator after the final EOS). Raises ValueError when there is no assistant message, the template is not
    prefix-preserving on this chat, or it does not end an assistant turn with the EOS token.
    """
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise ValueError("it has no assistant message, so nothing would be trained on")
    eos = tokenizer.eos_token_id
    prompt_ids = render_ids(tokenizer, messages[:turns[0]], tools=tools, add_generation_prompt=True)
    so_far, response_ids, response_mask = list(prompt_ids), [], []
    for i in turns:
        before = (prompt_ids if i == turns[0] else
                  render_ids(tokenizer, messages[:i], tools=tools, add_generation_prompt=True))
        through = render_ids(tokenizer, messages[:i + 1], tools=tools, add_generation_prompt=False)
        if before[:len(so_far)] != so_far or through[:len(before)] != before:
            raise ValueError(f"the chat template is not prefix-preserving on it (rendering message {i} changes the ids "
                             "of the messages before it), so its turns cannot be told apart; use a template that "
                             "renders history unchanged")
        turn = through[len(before):]
        if eos not in turn:
            raise ValueError(f"the chat template does not end its assistant message {i} with the EOS token "
                             f"{tokenizer.eos_token!r}; set the tokenizer's eos_token to the template's end-of-turn "
                             "token")
        end = len(turn) - turn[::-1].index(eos)
        extend_response(response_ids, response_mask, before[len(so_far):], trained=False)
        extend_response(response_ids, response_mask, turn[:end], trained=True)
        so_far = before + turn[:end]
    return prompt_ids, response_ids, response_mask


def data_ids(tokenizer, text: str) -> list[int]:
    """``text`` as data: its ids with no special token parsed out of it (a tool result holding ``<|im_end|>`` stays
    those characters), and none added."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


_MARK = "\ue000fsdptrain-content-{}\ue001"
"""A placeholder for a message's content while the template renders (private-use characters: no text holds them)."""


def render_ids_as_data(tokenizer, messages: Sequence[dict], *, tools: Optional[Sequence[dict]],
                       add_generation_prompt: bool, data_roles: Optional[frozenset] = None) -> Optional[list[int]]:
    """The ids of :func:`render_text` where only the template's own text can give special tokens: each string
    content of a message whose role is in ``data_roles`` (every role when None) is tokenized as data
    (:func:`data_ids`). None when the template does not write those contents verbatim (rendering with placeholders
    and putting the contents back does not give the template's text), so the caller decides."""
    data = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)
            and (data_roles is None or m.get("role") in data_roles)]
    marked = [dict(m) for m in messages]
    for i in data:
        marked[i]["content"] = _MARK.format(i)
    template = render_text(tokenizer, marked, tools=tools, add_generation_prompt=add_generation_prompt)
    pieces, rest = [], template
    for i in data:
        before, found, rest = rest.partition(_MARK.format(i))
        if not found or _MARK.format(i) in rest:
            return None
        pieces.append(before)
    texts = [messages[i]["content"] for i in data]
    if "".join(p + t for p, t in zip(pieces, texts)) + rest != render_text(
            tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt):
        return None
    ids = []
    for piece, text in zip(pieces, texts):
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"] + data_ids(tokenizer, text)
    return ids + list(tokenizer(rest, add_special_tokens=False)["input_ids"])


def without_special_tokens(tokenizer, text: str) -> str:
    """``text`` with every special token's string removed, until none is left (for a template that rewrites
    contents, where :func:`render_ids_as_data` cannot keep them apart)."""
    specials = [t for t in tokenizer.all_special_tokens if t]
    while True:
        cleaned = text
        for token in specials:
            cleaned = cleaned.replace(token, "")
        if cleaned == text:
            return text
        text = cleaned


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one assistant turn (``name``, ``arguments``) and whether the turn held a malformed call."""

    calls: list[tuple[str, dict]]
    malformed: bool


def parse_tool_calls_text(text: str) -> ParsedTurn:
    """The ``<tool_call>{json}</tool_call>`` blocks of ``text``. Each must hold a JSON object with a string ``name``
    and an object ``arguments`` (a JSON string of an object is accepted, as some models write it); anything else, or
    an opening tag without its closing one, makes the turn malformed."""
    calls = []
    for block in TOOL_CALL_PATTERN.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return ParsedTurn([], malformed=True)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedTurn([], malformed=True)
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ParsedTurn([], malformed=True)
        if not isinstance(arguments, dict):
            return ParsedTurn([], malformed=True)
        calls.append((call["name"], arguments))
    if text.count("<tool_call>") != len(calls) or text.count("</tool_call>") != len(calls):
        return ParsedTurn([], malformed=True)
    return ParsedTurn(calls, malformed=False)


_DATA_ROLES = frozenset({"system", "user", "tool"})
"""The roles whose contents :class:`ChatTurns` tokenizes as data (what the user, a tool or an environment wrote)."""


SEGMENT_MEMO_SIZE = 4096
"""How many distinct tool-message segments (and tool results' ids) a :class:`ChatTurns` remembers (then it starts
again)."""
RESULT_MEMO_CHARS = 1024
"""The longest tool result whose ids a :class:`ChatTurns` remembers (a memo of 4096 such is at most 4 MiB of text)."""


def _remembered(memo: dict[str, list[int]], key: str, make: Callable[[], list[int]]) -> list[int]:
    """A copy of ``memo[key]``, made by ``make`` when missing; the memo starts again once it holds
    ``SEGMENT_MEMO_SIZE`` keys."""
    if (ids := memo.get(key)) is None:
        if len(memo) >= SEGMENT_MEMO_SIZE:
            memo.clear()
        ids = memo[key] = make()
    return list(ids)


class ChatTurns:
    """A tokenizer's chat template as the turn loop uses it: the prompt's ids, the ids that follow an assistant turn
    with tool messages, and parsing a turn's calls. Built once at start-up; the constructor checks the template
    (ConfigError, one line, naming why): it must render the tools, end an assistant turn with the EOS token, and be
    prefix-preserving."""

    def __init__(self, tokenizer, tools: Sequence[dict]):
        self.tokenizer, self.tools = tokenizer, list(tools)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("rollout.tools / rollout.environment need a tokenizer with a chat template that renders "
                              "tools; this tokenizer has no chat_template")
        probe = [{"role": "user", "content": "Hi."}]
        if (render_ids(tokenizer, probe, tools=[_DUMMY_TOOL], add_generation_prompt=True)
                == render_ids(tokenizer, probe, tools=None, add_generation_prompt=True)):
            raise ConfigError("rollout.tools / rollout.environment: the tokenizer's chat template renders no tools "
                              "(apply_chat_template(tools=...) writes the same prompt as without them); use a "
                              "tokenizer whose template supports tools")
        self.eos_id = tokenizer.eos_token_id
        self._opening = [{"role": "user", "content": "Hi."},
                         {"role": "assistant", "content": "<think>\nA.\n</think>\n\nB."}]
        opening_ids = self.render(self._opening)
        if self.eos_id not in opening_ids[len(self.render(probe, generation_prompt=True)):]:
            raise ConfigError("rollout.tools / rollout.environment: the chat template does not end an assistant "
                              f"turn with the EOS token {tokenizer.eos_token!r}, so a turn's end cannot be found in "
                              "the sampled ids; set the tokenizer's eos_token to the template's end-of-turn token")
        last_eos = len(opening_ids) - 1 - opening_ids[::-1].index(self.eos_id)
        self.after_eos = opening_ids[last_eos + 1:]
        """What the template writes after an assistant turn's EOS (ChatML: ``\\n``)."""
        self._opening_ids = opening_ids
        self._check_prefix_preserving()
        self._longest_token = max(map(len, tokenizer.get_vocab()), default=1)
        self._segments: dict[str, list[int]] = {}
        self._results: dict[str, list[int]] = {}

    def max_chars(self, num_tokens: int) -> int:
        """How many characters of a text surely hold its first ``num_tokens`` tokens (with 8 to spare past the
        boundary): a long tool result is cut to this many characters before it is tokenized (docs/multi-turn.md).
        No token covers more characters than its vocabulary string has (x4 for normalizers that fold characters)."""
        return 4 * (num_tokens + 8) * self._longest_token

    def render(self, messages: Sequence[dict], *, generation_prompt: bool = False) -> list[int]:
        """The template's ids of ``messages``; every content but the assistant's (the policy's own sampled ids) is
        data: no special token comes out of a prompt, an environment's observation or a tool result."""
        ids = render_ids_as_data(self.tokenizer, messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                 data_roles=_DATA_ROLES)
        if ids is None:
            roles = sorted({m.get("role") for m in messages if m.get("role") in _DATA_ROLES})
            raise ConfigError(f"rollout.tools / rollout.environment: the tokenizer's chat template does not write the "
                              f"content of {'/'.join(map(str, roles))} messages verbatim, so tool and environment "
                              f"text cannot be kept apart from its control tokens; use a template that writes "
                              f"message contents as they are")
        return ids

    def _check_prefix_preserving(self) -> None:
        """Rendering a longer conversation must start with the shorter one's ids (a template that rewrites history,
        e.g. strips earlier ``<think>`` blocks, breaks token-in/token-out)."""
        tool = [{"role": "tool", "name": "fsdptrain_probe", "content": "C."}]
        second = [{"role": "assistant", "content": "<think>\nD.\n</think>\n\nE."}]
        steps = [self._opening, self._opening + tool, self._opening + tool + second]
        for shorter, longer in zip(steps, steps[1:]):
            short_ids = self.render(shorter, generation_prompt=shorter[-1]["role"] == "tool")
            if self.render(longer)[:len(short_ids)] != short_ids:
                raise ConfigError("rollout.tools / rollout.environment: the tokenizer's chat template is not "
                                  "prefix-preserving (rendering a longer conversation changes the ids of its earlier "
                                  "turns, e.g. it strips earlier <think> blocks), so the trained ids would not be "
                                  "the sampled ones; use a template that renders history unchanged")

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The ids generation starts from: the prompt's messages with the generation prompt."""
        return self.prompt(messages)[1]

    def prompt(self, messages: Sequence[dict]) -> tuple[str, list[int]]:
        """:meth:`prompt_ids` with their text, rendered once: what the policy sees, the tools' schemas included."""
        text = render_text(self.tokenizer, messages, tools=self.tools, add_generation_prompt=True)
        return text, self.render(messages, generation_prompt=True)

    def tool_segment_ids(self, tool_messages: Sequence[dict]) -> list[int]:
        """The ids that follow an assistant turn's EOS when ``tool_messages`` answer it: the template's separator
        after the EOS, the tool messages, and the next generation prompt. Remembered for the last
        ``SEGMENT_MEMO_SIZE`` distinct tool messages: the samples of a group often make the same call and get the same
        result, and rendering the template (twice, with the tools' schemas) costs a millisecond or more where the
        rest of a turn's bookkeeping costs microseconds."""
        key = json.dumps(list(tool_messages), sort_keys=True, default=repr)
        return _remembered(self._segments, key, lambda: self._tool_segment_ids(tool_messages))

    def result_ids(self, text: str) -> list[int]:
        """:func:`data_ids` of a tool result ``text``, remembered for the last ``SEGMENT_MEMO_SIZE`` distinct results
        up to ``RESULT_MEMO_CHARS`` characters: a group's samples often get the same result, and a call of the
        tokenizer costs about 75 us (its Python around a one-text batch) where the rest of appending a result costs a
        few (the tools row of benchmarks/rollout.py tokenized about 200 results a rollout)."""
        if len(text) > RESULT_MEMO_CHARS:
            return data_ids(self.tokenizer, text)
        return _remembered(self._results, text, lambda: data_ids(self.tokenizer, text))

    def _tool_segment_ids(self, tool_messages: Sequence[dict]) -> list[int]:
        full = self.render([*self._opening, *tool_messages], generation_prompt=True)
        if full[:len(self._opening_ids)] != self._opening_ids:
            raise ConfigError("the tokenizer's chat template is not prefix-preserving for tool messages (rendering them "
                              "changes the ids of the turns before)")
        return self.after_eos + full[len(self._opening_ids):]

    def parse(self, sampled_ids: Sequence[int], *, prefix_ids: Sequence[int]) -> ParsedTurn:
        """The calls of one assistant turn (its sampled ids, EOS included or not): the tokenizer's
        ``parse_response`` when it has a ``response_template``, else :func:`parse_tool_calls_text` of the text
        decoded with special tokens kept."""
        if getattr(self.tokenizer, "response_template", None) is not None:
            try:
                message = self.tokenizer.parse_response(list(sampled_ids), prefix=list(prefix_ids), tools=self.tools)
            except Exception:  # the tokenizer's parser rejects what the model wrote: a malformed call
                return ParsedTurn([], malformed=True)
            calls = []
            for call in message.get("tool_calls") or []:
                function = call.get("function", call)
                arguments = function.get("arguments", {})
                if not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
                    return ParsedTurn([], malformed=True)
                calls.append((function["name"], arguments))
            return ParsedTurn(calls, malformed=False)
        return parse_tool_calls_text(self.tokenizer.decode(list(sampled_ids), skip_special_tokens=False))
