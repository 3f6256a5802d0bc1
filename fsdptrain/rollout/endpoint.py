"""The OpenAI-compatible endpoint served during an agent run's rollouts (docs/agents.md): a caller of the run's
:class:`~fsdptrain.generation.decoder.Decoder`, not an engine.

One trajectory is one :class:`Session`: its own base URL (``/s/<token>/v1``), its turn counter (each completion is
the next turn, seeded by the sampler's ``seeds(turn)``: ``row_seed`` in training) and its kept context. The session
keeps the exact ids of what it rendered (mask 0) and of what the engine sampled (mask 1). A request whose messages
extend the previous turn's (the previous request's messages, then the assistant message returned, then messages that
are not the assistant's) is a follow-up :class:`~fsdptrain.generation.decoder.Request` onto the kept context: only
the new messages are rendered (as data, on the template's separator after the sampled EOS), the sampled text is never
rendered again. Any other request (history edited or dropped, other tools, a turn cut by its cap) starts a new
:class:`Segment`, rendered whole from the request's messages.

Threads: requests are served on the server's threads (parsing, rendering, the answer); the engine runs in the
sampler's thread inside its ``generating`` block, and takes each session's next request from a future the session
resolves (:meth:`Session.next_request`). :meth:`Endpoint.on_finish` is the decoder's ``on_finish``: it hands the
engine's :class:`~fsdptrain.generation.decoder.Generated` to the waiting request and returns the session's next
future (none once the session is finished), so the decode ends when every session has.

Why the standard library's ``ThreadingHTTPServer``: the endpoint carries a handful of small JSON requests per
trajectory turn on the loopback, and the work behind each is the engine's; an ASGI stack would add dependencies and an
event loop of its own, to serve what a thread per connection serves (docs/agents.md measures the overhead).

What a request may ask (:func:`check_chat_request`): honoured: ``messages``, ``tools``, ``tool_choice`` (``auto`` or
``none``), ``max_tokens`` / ``max_completion_tokens`` (capped by the trajectory's budget), ``logprobs`` (the behaviour
log-probs the loss uses), ``temperature`` / ``top_p`` equal to the run's, ``n`` = 1. Refused with 400: any other
``temperature`` / ``top_p`` (the answer names the run's value: the loss scores the tokens at the run's), ``n`` > 1,
``stream``, ``stop``, ``top_logprobs`` > 0, non-zero penalties, ``logit_bias``, ``response_format`` other than text,
``tool_choice`` ``required`` or a named function. Ignored: ``model``, ``seed`` (the row seed decides), ``user``,
``metadata``, ``parallel_tool_calls``, ``store``, ``service_tier`` and any other field.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import TOOL_CALL_PATTERN, ChatTurns, data_ids, extend_response, render_ids_as_data
from fsdptrain.generation.decoder import Generated, Request, Sampling

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body read; a larger one is answered 413 unread."""
MAX_MESSAGES = 1024
"""Most messages one chat request may hold (400 beyond)."""
CHAT_TURNS_MEMO = 64
"""How many distinct tool lists the endpoint keeps a checked :class:`ChatTurns` for."""
PROMPT_MEMO = 256
"""How many distinct rendered contexts (messages and tools) the endpoint keeps: the ``rollout.n`` agents of a prompt
open their trajectories with the same messages, and rendering them (the chat template twice, then the tokenizer)
costs more than the rest of a request."""
MODEL_NAME = "policy"
"""The one model ``/v1/models`` lists (a request's ``model`` is ignored)."""

_IGNORED_PENALTIES = ("presence_penalty", "frequency_penalty")


class RequestError(Exception):
    """A request the endpoint answers with ``status`` and ``message`` (never a crash of the run)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Segment:
    """One exactly rendered context and what followed it: ``prompt_ids`` (the first request's rendering), then the
    response (sampled ids mask 1, rendered ids mask 0) with the behaviour log-probs (0.0 where not sampled), the
    conversation as the session knows it, and how many of its messages the prompt held."""

    prompt_ids: list[int]
    messages: list[dict]
    num_prompt_messages: int
    prompt_text: str = ""
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_turns: int = 0

    @property
    def num_sampled(self) -> int:
        return sum(self.response_mask)


@dataclass
class _Kept:
    """What continues the session's last turn: the engine's kept context, the turn's last sampled id, whether it
    ended on EOS, the tools it was rendered with, and (``/v1/completions``) the prompt text it extends."""

    kept: object
    last_id: int
    ended: bool
    tools_key: str
    text: Optional[str] = None


class Session:
    """One trajectory's session; see the module docstring. ``seeds(turn)`` is the seed of its turn ``turn``."""

    def __init__(self, key: int, seeds: Callable[[int], Optional[int]], *, max_new_tokens: int, max_turns: int):
        self.key, self.seeds = key, seeds
        self.token = secrets.token_urlsafe(12)
        self.max_new_tokens, self.max_turns = max_new_tokens, max_turns
        self.segments: list[Segment] = []
        self.num_turns = 0
        self.num_requests = 0
        self.num_refused = 0
        self.truncation: Optional[str] = None
        self.finished = False
        self._state = threading.Lock()
        self._busy = threading.Lock()
        self._next: concurrent.futures.Future = concurrent.futures.Future()
        self._reply: Optional[concurrent.futures.Future] = None
        self._kept: Optional[_Kept] = None

    @property
    def next_request(self) -> concurrent.futures.Future:
        """The future of this session's next :class:`Request` (None once it is finished)."""
        return self._next

    def finish(self) -> None:
        """No request follows (the agent returned, raised or timed out): a later request is a 409, and the engine
        stops waiting for this session."""
        with self._state:
            self.finished = True
            if not self._next.done():
                self._next.set_result(None)
            if self._reply is not None and not self._reply.done():
                self._reply.set_exception(RequestError(409, "the session finished while its request waited"))

    def _submit(self, request: Request) -> concurrent.futures.Future:
        with self._state:
            if self.finished:
                raise RequestError(409, "session finished: its rollout has ended")
            self._reply = concurrent.futures.Future()
            self._next.set_result(request)
            return self._reply

    def _generated(self, generated: Generated) -> Optional[concurrent.futures.Future]:
        """The engine's answer to the waiting request; the future of the next request (None: finished)."""
        with self._state:
            reply, self._reply = self._reply, None
            self._next = concurrent.futures.Future()
            follow = None if self.finished else self._next
        if reply is not None and not reply.done():
            reply.set_result(generated)
        return follow

    def trained(self) -> Segment:
        """The segment trained: the last one (docs/agents.md, "What is trained")."""
        return self.segments[-1]


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES


def _normal(message: dict) -> dict:
    """What of a message decides whether a request extends the session: role, content (text parts joined; None is
    ''), name, and each tool call's name and parsed arguments."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append((fn.get("name"), json.dumps(arguments, sort_keys=True)))
    return {"role": message.get("role"), "content": content or "", "name": message.get("name"), "calls": calls}


def _plain_messages(messages: list) -> list[dict]:
    """The request's messages as the chat template takes them: text parts joined, tool call arguments as objects."""
    out = []
    for m in messages:
        n = _normal(m)
        plain = {"role": n["role"], "content": n["content"]}
        if m.get("name") is not None:
            plain["name"] = m["name"]
        if m.get("tool_call_id") is not None:
            plain["tool_call_id"] = m["tool_call_id"]
        if n["calls"]:
            plain["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": json.loads(args)}}
                                   for name, args in n["calls"]]
        out.append(plain)
    return out


def check_chat_request(body, sampling: Sampling, limits: Limits) -> None:
    """RequestError(400) naming the field for what the endpoint refuses (module docstring)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list")
    if len(messages) > limits.max_messages:
        raise RequestError(400, f"messages holds {len(messages)} messages; at most {limits.max_messages}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(400, f"messages[{i}] must be an object with role system, user, assistant or tool")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(400, f"messages[{i}].content must be a string, a list of text parts or null")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise RequestError(400, f"messages[{i}].tool_calls must be a list of function calls with names")
    check_sampling(body, sampling)
    if body.get("n", 1) not in (1, None):
        raise RequestError(400, f"n={body['n']!r} is refused: a session is one trajectory (rollout.n sets the "
                                f"group's samples); use n=1")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "tools must be a list of tool objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(400, f"tool_choice={choice!r} is refused: the policy decides whether to call (use auto "
                                f"or none)")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError(400, "response_format is refused: the policy's tokens are not constrained")


def check_sampling(body: dict, sampling: Sampling) -> None:
    """The fields every completion request shares; the sampling settings must be the run's (the loss scores the
    tokens at them)."""
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        got = body.get(name)
        if got is not None and sampling.mode != "greedy" and (
                not isinstance(got, (int, float)) or abs(float(got) - value) > 1e-9):
            raise RequestError(400, f"{name}={got!r} is refused: this run samples at {name}={value:g} and trains on "
                                    f"the tokens as sampled there (omit {name}, or send {value:g})")
    if body.get("stream"):
        raise RequestError(400, "stream=true is refused: the endpoint answers whole completions")
    if body.get("stop"):
        raise RequestError(400, "stop is refused: a turn ends at the model's EOS or its max_tokens")
    if body.get("top_logprobs"):
        raise RequestError(400, "top_logprobs is refused: the endpoint returns the sampled tokens' log-probs only")
    for name in _IGNORED_PENALTIES:
        if body.get(name):
            raise RequestError(400, f"{name}={body[name]!r} is refused: it would change the sampled distribution")
    if body.get("logit_bias"):
        raise RequestError(400, "logit_bias is refused: it would change the sampled distribution")
    for name in ("max_tokens", "max_completion_tokens"):
        got = body.get(name)
        if got is not None and (not isinstance(got, int) or isinstance(got, bool) or got < 1):
            raise RequestError(400, f"{name}={got!r} must be a positive integer")


class Endpoint:
    """The server and the sessions of one sampling call; ``with Endpoint(...) as endpoint`` serves on a free
    loopback port and stops (no port left open) when the block ends."""

    def __init__(self, sessions: Sequence[Session], tokenizer, sampling: Sampling, *, limits: Limits = Limits()):
        self.sessions = {s.token: s for s in sessions}
        self.tokenizer, self.sampling, self.limits = tokenizer, sampling, limits
        self.key = "fsdptrain-" + secrets.token_urlsafe(24)
        self._chats: dict[str, ChatTurns] = {}
        self._prompts: dict[str, tuple[Optional[list[int]], str]] = {}
        self._render = threading.Lock()
        """Held while a request renders or answers: a tokenizer is not for concurrent use (its Rust side borrows
        itself mutably), and the GIL would serialise the work anyway."""
        self._specials = [t for t in tokenizer.all_special_tokens if t]
        self.server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self.stopped = False
        self.request_seconds: list[float] = []
        """Per answered completion, the seconds the server spent on it outside the engine (parsing, rendering, the
        answer): the endpoint's own overhead (benchmarks/agents.py)."""

    # the server -----------------------------------------------------------------------------------------------------

    def __enter__(self) -> "Endpoint":
        endpoint = self

        class Handler(_Handler):
            owner = endpoint

        self.server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="fsdptrain-endpoint")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def base_url(self, session: Session) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session.token}/v1"

    def stop(self) -> None:
        """Every session finished, the listening socket closed and every open connection shut."""
        if self.stopped:
            return
        self.stopped = True
        for session in self.sessions.values():
            session.finish()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        with self._connections_lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._connections.clear()

    # the engine's side ----------------------------------------------------------------------------------------------

    def on_finish(self, finished: list[Generated]) -> list:
        """The decoder's ``on_finish``: each generated turn to its waiting request; the sessions' next futures."""
        follow = []
        for generated in finished:
            session = self._by_key[generated.key]
            nxt = session._generated(generated)
            if nxt is not None:
                follow.append(nxt)
        return follow

    def requests(self) -> list[concurrent.futures.Future]:
        """What the decode starts from: every session's first request, to come."""
        self._by_key = {s.key: s for s in self.sessions.values()}
        return [s.next_request for s in self.sessions.values()]

    # one request ----------------------------------------------------------------------------------------------------

    def chat_turns(self, tools: list[dict]) -> tuple[str, ChatTurns]:
        key = json.dumps(tools, sort_keys=True)
        chat = self._chats.get(key)
        if chat is None:
            try:
                chat = ChatTurns(self.tokenizer, tools)
            except ConfigError as err:
                raise RequestError(400, f"tools: {str(err).split(': ', 1)[-1]}") from None
            if len(self._chats) >= CHAT_TURNS_MEMO:
                self._chats.clear()
            self._chats[key] = chat
        return key, chat

    def _check_no_control_text(self, body: dict) -> None:
        """Text the template writes itself (tool schemas, call names and arguments, roles, names) must hold no
        special token: only message contents are tokenized as data."""
        outside = {k: v for k, v in body.items() if k != "messages"}
        outside["messages"] = [{k: v for k, v in m.items() if k != "content"} for m in body["messages"]]
        text = json.dumps(outside, ensure_ascii=False)
        for token in self._specials:
            if token in text:
                raise RequestError(400, f"the request holds the control token {token!r} outside a message's content")

    def chat_completion(self, session: Session, body: dict) -> dict:
        check_chat_request(body, self.sampling, self.limits)
        started = time.perf_counter()
        with self._render:
            prepared = self._prepare_chat(session, body, started)
        if isinstance(prepared, dict):
            return prepared
        segment, chat, request_ids, kept, tools_key = prepared
        generated, context = self._decode(session, segment, request_ids, kept, body, started)
        with self._render:
            return self._chat_answer(session, segment, chat, generated, context, body, tools_key, started)

    def _prepare_chat(self, session: Session, body: dict, started: float):
        """The turn's ids: a follow-up onto the kept context, or a new segment; or the answer once the budget is
        spent."""
        self._check_no_control_text(body)
        tools = body.get("tools") or []
        tools_key, chat = self.chat_turns(tools)
        messages = _plain_messages(body["messages"])
        normal = [_normal(m) for m in body["messages"]]
        session.num_requests += 1
        segment = session.segments[-1] if session.segments else None
        kept = session._kept
        extends = (segment is not None and kept is not None and kept.ended and kept.tools_key == tools_key
                   and kept.text is None and len(normal) > len(segment.messages)
                   and [_normal(m) for m in segment.messages] == normal[:len(segment.messages)]
                   and all(m["role"] != "assistant" for m in normal[len(segment.messages):]))
        if extends:
            delta = messages[len(segment.messages):]
            new_ids = chat.tool_segment_ids(delta)
            if not self._fits(session, segment, len(new_ids)):
                return self._spent(session, "tool_overflow", started)
            extend_response(segment.response_ids, segment.response_mask, new_ids, trained=False)
            segment.logprobs.extend([0.0] * len(new_ids))
            segment.messages.extend(delta)
            request_ids = [kept.last_id] + new_ids
        else:
            ids, text = self._rendered(messages, tools, tools_key)
            if ids is None:
                raise RequestError(400, "the chat template does not write these messages' contents verbatim, so "
                                        "they cannot be kept apart from its control tokens")
            segment = Segment(prompt_ids=list(ids), messages=list(messages), num_prompt_messages=len(messages),
                              prompt_text=text)
            if not self._fits(session, segment, 0):
                return self._spent(session, "length", started)
            session.segments.append(segment)
            request_ids, kept = ids, None
        return segment, chat, request_ids, kept, tools_key

    def _rendered(self, messages: list[dict], tools: list[dict], tools_key: str) -> tuple[Optional[list[int]], str]:
        """The ids (None: not renderable as data) and text of a new segment's context, rendered once per distinct
        messages and tools (:data:`PROMPT_MEMO`); the caller holds the render lock."""
        key = json.dumps(messages, sort_keys=True) + tools_key
        found = self._prompts.get(key)
        if found is None:
            ids = render_ids_as_data(self.tokenizer, messages, tools=tools or None, add_generation_prompt=True)
            found = (ids, self.tokenizer.decode(ids, skip_special_tokens=False) if ids is not None else "")
            if len(self._prompts) >= PROMPT_MEMO:
                self._prompts.clear()
            self._prompts[key] = found
        return found

    @staticmethod
    def _fits(session: Session, segment: Segment, num_new: int) -> bool:
        """Room for ``num_new`` more rendered ids and a sampled one in ``segment``, and a turn left."""
        return (session.num_turns < session.max_turns
                and len(segment.response_ids) + num_new < session.max_new_tokens)

    def _spent(self, session: Session, cause: str, started: float) -> dict:
        """The answer once the trajectory's budget (``rollout.max_new_tokens``, ``rollout.max_turns``) is spent: an
        empty completion that ended by length (the trajectory is truncated; nothing is appended)."""
        session.truncation = "max_turns" if session.num_turns >= session.max_turns else cause
        session.num_refused += 1
        self.request_seconds.append(time.perf_counter() - started)
        return _completion_object("chat.completion", [{"index": 0, "finish_reason": "length", "logprobs": None,
                                                       "message": {"role": "assistant", "content": ""}}],
                                  prompt_tokens=0, completion_tokens=0,
                                  extra={"token_ids": [], "segment": len(session.segments) - 1, "turn": None})

    def _decode(self, session: Session, segment: Segment, request_ids: list[int], kept: Optional[_Kept], body: dict,
                started: float) -> tuple[Generated, list[int]]:
        """The turn through the engine: the request on the session's next future, the answer awaited."""
        budget = session.max_new_tokens - len(segment.response_ids)
        cap = min(x for x in (budget, body.get("max_tokens"), body.get("max_completion_tokens")) if x is not None)
        request = Request(session.key, request_ids, cap, seed=session.seeds(session.num_turns),
                          kept=kept.kept if kept is not None else None, keep=True)
        waited = time.perf_counter()
        reply = session._submit(request)
        generated = reply.result()
        self.request_seconds.append(waited - started)
        session.num_turns += 1
        segment.num_turns += 1
        extend_response(segment.response_ids, segment.response_mask, generated.new_ids, trained=True)
        segment.logprobs.extend(float(x) for x in generated.logprobs[:len(generated.new_ids)])
        if len(generated.logprobs) < len(generated.new_ids):
            segment.logprobs.extend([0.0] * (len(generated.new_ids) - len(generated.logprobs)))
        return generated, segment.prompt_ids + segment.response_ids[:-len(generated.new_ids) or None]

    def _chat_answer(self, session: Session, segment: Segment, chat: ChatTurns, generated: Generated,
                     context: list[int], body: dict, tools_key: str, started: float) -> dict:
        answered = time.perf_counter()
        ids = generated.new_ids
        text = self.tokenizer.decode(ids[:-1] if generated.ended else ids, skip_special_tokens=False)
        message: dict = {"role": "assistant", "content": text}
        finish = "stop" if generated.ended else "length"
        calls = []
        if generated.ended and body.get("tool_choice") != "none":
            parsed = chat.parse(ids, prefix_ids=context)
            calls = [] if parsed.malformed else parsed.calls
        if calls:
            message["content"] = TOOL_CALL_PATTERN.sub("", text).strip() or None
            message["tool_calls"] = [{"id": f"call_{session.num_turns}_{i}", "type": "function",
                                      "function": {"name": name, "arguments": json.dumps(arguments)}}
                                     for i, (name, arguments) in enumerate(calls)]
            finish = "tool_calls"
        if not generated.ended:
            session.truncation = "length"
        segment.messages.append(_plain_messages([message])[0])
        session._kept = _Kept(generated.kept, ids[-1], generated.ended, tools_key)
        logprobs = None
        if body.get("logprobs"):
            logprobs = {"content": [_token_logprob(self.tokenizer, t, lp) for t, lp in zip(ids, generated.logprobs)]}
        self.request_seconds[-1] += time.perf_counter() - answered
        return _completion_object("chat.completion", [{"index": 0, "finish_reason": finish, "message": message,
                                                       "logprobs": logprobs}],
                                  prompt_tokens=len(context), completion_tokens=len(ids),
                                  extra={"token_ids": list(ids), "segment": len(session.segments) - 1,
                                         "turn": session.num_turns - 1})

    def completion(self, session: Session, body: dict) -> dict:
        """``/v1/completions``: the prompt text tokenized as data (no control token from it); a prompt that starts
        with the previous prompt and completion (as text) continues the kept context with only the rest."""
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "prompt must be a non-empty string")
        if len(prompt) > self.limits.max_body_bytes:
            raise RequestError(413, "prompt is too long")
        check_sampling(body, self.sampling)
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, f"n={body['n']!r} is refused: a session is one trajectory; use n=1")
        if body.get("echo") or body.get("suffix") or body.get("best_of", 1) not in (1, None):
            raise RequestError(400, "echo, suffix and best_of are refused")
        started = time.perf_counter()
        with self._render:
            prepared = self._prepare_completion(session, prompt, started)
        if isinstance(prepared, dict):
            return prepared
        segment, request_ids, kept = prepared
        generated, context = self._decode(session, segment, request_ids, kept, body, started)
        with self._render:
            return self._completion_answer(session, generated, context, prompt, body)

    def _prepare_completion(self, session: Session, prompt: str, started: float):
        session.num_requests += 1
        kept = session._kept
        segment = session.segments[-1] if session.segments else None
        if (segment is not None and kept is not None and kept.text is not None and prompt.startswith(kept.text)
                and len(prompt) > len(kept.text)):
            new_ids = data_ids(self.tokenizer, prompt[len(kept.text):])
            if not self._fits(session, segment, len(new_ids)):
                return self._spent(session, "tool_overflow", started)
            extend_response(segment.response_ids, segment.response_mask, new_ids, trained=False)
            segment.logprobs.extend([0.0] * len(new_ids))
            request_ids = [kept.last_id] + new_ids
        else:
            ids = data_ids(self.tokenizer, prompt)
            segment = Segment(prompt_ids=ids, messages=[], num_prompt_messages=0, prompt_text=prompt)
            if not self._fits(session, segment, 0):
                return self._spent(session, "length", started)
            session.segments.append(segment)
            request_ids, kept = ids, None
        return segment, request_ids, kept

    def _completion_answer(self, session: Session, generated: Generated, context: list[int], prompt: str,
                           body: dict) -> dict:
        answered = time.perf_counter()
        ids = generated.new_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not generated.ended:
            session.truncation = "length"
        session._kept = _Kept(generated.kept, ids[-1], generated.ended, "", text=prompt + text)
        logprobs = None
        if body.get("logprobs"):
            logprobs = {"tokens": [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                        "token_logprobs": list(generated.logprobs), "top_logprobs": None, "text_offset": None}
        self.request_seconds[-1] += time.perf_counter() - answered
        return _completion_object("text_completion", [{"index": 0, "text": text, "logprobs": logprobs,
                                                       "finish_reason": "stop" if generated.ended else "length"}],
                                  prompt_tokens=len(context), completion_tokens=len(ids),
                                  extra={"token_ids": list(ids), "segment": len(session.segments) - 1,
                                         "turn": session.num_turns - 1})


def _token_logprob(tokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode()), "top_logprobs": []}


def _completion_object(kind: str, choices: list, *, prompt_tokens: int, completion_tokens: int, extra: dict) -> dict:
    """An OpenAI completion object; ``fsdptrain`` (an extra field clients keep) holds the sampled ids, the segment
    and the turn."""
    return {"id": "cmpl-" + secrets.token_hex(8), "object": kind, "created": int(time.time()), "model": MODEL_NAME,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens},
            "fsdptrain": extra}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: every agent of a rank may connect at once (5 resets the rest)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away (a cancelled agent) is not the run's error


class _Handler(BaseHTTPRequestHandler):
    owner: Endpoint
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.owner._connections_lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.owner._connections_lock:
                self.owner._connections.discard(self.connection)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the standard library's name)
        pass

    def do_GET(self) -> None:
        self._serve(lambda session, route: self._models(route))

    def do_POST(self) -> None:
        self._serve(self._post)

    def _models(self, route: str) -> dict:
        if route != "/v1/models":
            raise RequestError(404, f"no route GET {route}")
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                            "owned_by": "fsdptrain"}]}

    def _post(self, session: Session, route: str) -> dict:
        body = self._body()
        if route == "/v1/chat/completions":
            call = self.owner.chat_completion
        elif route == "/v1/completions":
            call = self.owner.completion
        else:
            raise RequestError(404, f"no route POST {route}")
        if not session._busy.acquire(blocking=False):
            raise RequestError(409, "the session is answering another request: one request at a time per "
                                    "trajectory")
        try:
            return call(session, body)
        finally:
            session._busy.release()

    def _body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411, "a Content-Length header is required")
        if int(length) > self.owner.limits.max_body_bytes:
            self.close_connection = True
            raise RequestError(413, f"the body holds {length} bytes; at most {self.owner.limits.max_body_bytes}")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(400, f"the body is not JSON: {err}") from None

    def _serve(self, handle) -> None:
        try:
            session, route = self._route()
            answer, status = handle(session, route), 200
        except RequestError as err:
            answer, status = {"error": {"message": str(err), "type": "invalid_request_error", "code": err.status}}, \
                err.status
        except Exception as err:  # noqa: BLE001 -- a request never crashes the run; the agent reads the cause
            answer, status = {"error": {"message": f"internal error: {type(err).__name__}: {err}",
                                        "type": "server_error", "code": 500}}, 500
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection or status == 413:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _route(self) -> tuple[Optional[Session], str]:
        owner = self.owner
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {owner.key}".encode()):
            if self.command == "POST":  # the body is not read: the connection goes
                self.close_connection = True
            raise RequestError(401, "a wrong or missing API key (the session's client carries the run's key)")
        if owner.stopped:
            self.close_connection = True
            raise RequestError(409, "the rollout phase has ended")
        parts = self.path.split("?")[0].split("/", 3)  # '', 's', token, rest
        if len(parts) < 4 or parts[1] != "s":
            raise RequestError(404, f"no route {self.path} (a session's base URL is /s/<session>/v1)")
        session = owner.sessions.get(parts[2])
        if session is None:
            raise RequestError(404, "unknown session")
        if session.finished:
            raise RequestError(409, "session finished: its rollout has ended")
        return session, "/" + parts[3]
