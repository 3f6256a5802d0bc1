"""Multi-turn trajectories built token-in/token-out: the turn loop over generated ids and tool messages and its caps
(docs/multi-turn.md).

A trajectory is one sample: the prompt's ids, then the response: each assistant turn's sampled ids exactly as
sampled (never decoded and re-encoded), followed after a tool call by the ids of the tool messages as the chat
template renders them, separators included (ChatML's ``\\n`` after ``<|im_end|>`` and the next
``<|im_start|>assistant\\n``). The response mask is 1 on the sampled ids and 0 on everything the template or a tool
wrote. Because the template is prefix-preserving (checked at start-up on a dummy conversation), the ids built turn by
turn equal the template's rendering of the final conversation, token for token, up to the separator the template
writes after the final EOS.

Tool calls are parsed from each turn's sampled ids: with the tokenizer's own response parsing
(``tokenizer.parse_response``) when it has a ``response_template``, else the common
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of the decoded text. A turn with no call ends the
trajectory; so does a malformed call (the turn stays as plain text; counted).

Caps (per trajectory): ``max_turns`` assistant turns (a call in the last allowed turn is not run: truncated by
``max_turns``); ``max_new_tokens`` response tokens, the model's and the tools' together (a turn cut by the budget is
truncated by ``length``; a tool segment that would not fit is not appended and ends the trajectory, truncated by
``tool_overflow``); ``max_tool_response_tokens`` tokens of one tool result's content (a longer one is cut and
counted).

Nothing here imports a model or runs a tool: the loop takes a :class:`~fsdptrain.generation.decoder.Decoder` and
``call_tools``, so it is tested with scripted ones (tests/unit/test_multi_turn.py). The chat rendering it builds on (the
template's ids, its checks, parsing a turn's calls) is :class:`fsdptrain.data.conversation.ChatTurns`.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

from fsdptrain.data.conversation import ChatTurns, extend_response
from fsdptrain.generation.decoder import Decoder, Generated, Request, Sampling

TRUNCATION_CAUSES = ("length", "max_turns", "tool_overflow")
"""Why a trajectory was truncated (``truncated/<cause>`` metrics)."""


@dataclass
class Trajectory:
    """One sample's multi-turn trajectory; see the module docstring. ``messages`` are the conversation after the
    prompt (assistant turns as written, with their parsed ``tool_calls``; tool messages as appended)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Per response token, the generating forward's log-prob of a sampled token (0.0 at a tool's or the template's)."""
    messages: list[dict] = field(default_factory=list)
    routes: list = field(default_factory=list)
    """A mixture-of-experts policy's routes recorded at generation, one ``[L, n, k]`` chunk per turn
    (``Generated.routes``: a turn's new ids, then its sampled ids but the last): together every position of prompt +
    response but the last; a tool's tokens are recorded by the next turn's prefill."""
    num_turns: int = 0
    num_calls: int = 0
    num_failed_calls: int = 0
    num_timed_out_calls: int = 0
    num_malformed: int = 0
    num_cut_results: int = 0
    num_tool_tokens: int = 0
    truncation: Optional[str] = None
    done: bool = False

    def end(self, truncation: Optional[str] = None) -> None:
        self.truncation, self.done = truncation, True


@dataclass(frozen=True)
class TurnCaps:
    max_turns: int
    max_new_tokens: int
    max_tool_response_tokens: int


CallTools = Callable[[list[tuple[int, str, dict]]], list]
"""``call_tools([(sample, name, arguments)]) -> [result]`` with ``result.content``, ``.failed``, ``.timed_out``."""
Placement = Callable[[int, int], tuple[Optional[int], Hashable, Optional[int]]]
"""``placement(sample, turn) -> (seed, batch, batch_seed)``: the turn's own seed (None: greedy or the batch's), and
the batch an engine that draws a batch from one generator decodes it in, with that batch's seed (Request's fields)."""


def run_turns(decoder: Decoder, sampling: Sampling, chat: ChatTurns, prompts: Sequence[list[int]], *,
              placement: Placement, call_tools: CallTools, caps: TurnCaps) -> list[Trajectory]:
    """The trajectories of ``prompts`` (prompt ids each), every turn through ``decoder`` (called inside its
    ``generating`` block); see the module docstring for what each cap does.

    A turn that calls tools hands its calls to a tool thread (one task per batch of turns that finished together:
    each hand-over costs the decode loop a GIL switch) while other rows decode; the trajectory then re-enters with
    only its new tokens (the turn's last sampled id, the tool messages and the template's separators) onto what the
    decoder kept of its context. A trajectory's turns are the same whichever engine decodes them, up to the draws."""
    trajectories = [Trajectory(prompt_ids=list(p)) for p in prompts]

    def request(sample: int, new_ids: list[int], finished: Optional[Generated]) -> Request:
        t = trajectories[sample]
        seed, batch, batch_seed = placement(sample, t.num_turns)
        return Request(sample, new_ids, caps.max_new_tokens - len(t.response_ids), seed=seed,
                       kept=finished.kept if finished else None, keep=t.num_turns + 1 < caps.max_turns,
                       batch=batch, batch_seed=batch_seed)

    tool_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tools")

    def after_tools(calling: list[tuple[Generated, list[tuple[str, dict]]]]) -> list[Request]:
        """One batch of turns' tool calls, run together; the trajectories' next turns."""
        results = iter(call_tools([(g.key, name, arguments) for g, calls in calling for name, arguments in calls]))
        follow = []
        for generated, calls in calling:
            t = trajectories[generated.key]
            before = len(t.response_ids)
            append_tool_results(chat, t, calls, [next(results) for _ in calls], caps)
            if not t.done:
                follow.append(request(generated.key, generated.new_ids[-1:] + t.response_ids[before:], generated))
        return follow

    def on_finish(finished: list[Generated]) -> list:
        calling = []
        for generated in finished:
            t = trajectories[generated.key]
            if generated.routes is not None:
                t.routes.append(generated.routes)
            calls = finish_turn(chat, t, generated.new_ids, generated.ended, budget=len(generated.new_ids),
                                last_turn=t.num_turns == caps.max_turns - 1, logprobs=generated.logprobs)
            if calls:
                calling.append((generated, calls))
        return [tool_thread.submit(after_tools, calling)] if calling else []

    # Not a `with` block: leaving on an exception (a stop signal's grace ran out, a ToolError) must not wait for a
    # tool call that may never return (fsdptrain/run/signals.py); the process leaves through os._exit anyway.
    try:
        decoder.decode([request(i, t.prompt_ids, None) for i, t in enumerate(trajectories)], sampling,
                       on_finish=on_finish)
    except BaseException:
        tool_thread.shutdown(wait=False, cancel_futures=True)
        raise
    tool_thread.shutdown()
    return trajectories


def finish_turn(chat: ChatTurns, t: Trajectory, new_ids: list[int], ended: bool, *, budget: int,
                last_turn: bool, logprobs: Sequence[float] = ()) -> Optional[list[tuple[str, dict]]]:
    """Append one assistant turn (``new_ids``, cut to ``budget``; ``ended``: it ended on EOS; ``logprobs``: the
    generating forward's, one per new id, or none) to ``t``; the tool calls to run next, or None when the trajectory
    ended here (no call, a malformed one, its length, its last turn)."""
    if len(new_ids) > budget:
        new_ids, ended = new_ids[:budget], False
    prefix = t.prompt_ids + t.response_ids
    extend_response(t.response_ids, t.response_mask, new_ids, trained=True)
    t.logprobs.extend([float(x) for x in logprobs[:len(new_ids)]] if len(logprobs) else [0.0] * len(new_ids))
    t.num_turns += 1
    text_ids = new_ids[:-1] if ended else new_ids
    message = {"role": "assistant", "content": chat.tokenizer.decode(text_ids, skip_special_tokens=False)}
    t.messages.append(message)
    if not ended:
        t.end("length")
        return None
    parsed = chat.parse(new_ids, prefix_ids=prefix)
    if parsed.malformed:
        t.num_malformed += 1
        t.end()
        return None
    if not parsed.calls:
        t.end()
        return None
    message["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments}}
                             for name, arguments in parsed.calls]
    if last_turn:
        t.end("max_turns")
        return None
    return parsed.calls


def append_tool_results(chat: ChatTurns, t: Trajectory, calls: list[tuple[str, dict]], results: list,
                         caps: TurnCaps) -> None:
    """Append the tool messages answering one turn's calls (each result cut to ``max_tool_response_tokens``), or end
    the trajectory as ``tool_overflow`` when their segment would not fit the response budget."""
    tokenizer = chat.tokenizer
    tool_messages = []
    num_cut = 0
    for (name, _), result in zip(calls, results):
        content = result.content[:chat.max_chars(caps.max_tool_response_tokens)]  # a 10 MB result is not tokenized
        content_ids = chat.result_ids(content)
        if len(content_ids) > caps.max_tool_response_tokens or len(content) < len(result.content):
            content = tokenizer.decode(content_ids[:caps.max_tool_response_tokens], skip_special_tokens=False)
            num_cut += 1
        tool_messages.append({"role": "tool", "name": name, "content": content})
    segment = chat.tool_segment_ids(tool_messages)
    t.num_calls += len(calls)
    t.num_failed_calls += sum(r.failed for r in results)
    t.num_timed_out_calls += sum(r.timed_out for r in results)
    t.num_cut_results += num_cut
    if len(t.response_ids) + len(segment) >= caps.max_new_tokens:  # no room left for the model to answer
        t.messages.extend({**m, "appended": False} for m in tool_messages)
        t.end("tool_overflow")
        return
    extend_response(t.response_ids, t.response_mask, segment, trained=False)
    t.logprobs.extend([0.0] * len(segment))
    t.num_tool_tokens += len(segment)
    t.messages.extend(tool_messages)
