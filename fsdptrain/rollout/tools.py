"""The user's tools and environment (``rollout.tools``, ``rollout.environment``), loaded and checked at start-up,
and called during multi-turn rollouts (docs/multi-turn.md).

The contract follows TRL's GRPOTrainer (``tools=``, ``environment_factory=``), so tools move between the two
unchanged:

- a tool is a plain function with type hints and a Google-style docstring; its JSON schema comes from transformers'
  ``get_json_schema`` and is what the chat template receives (``apply_chat_template(tools=...)``);
- an environment is a class built once per sample with no arguments; ``reset(**row_columns)`` starts an episode
  and may return a string, appended to the prompt's last user message; its other public methods are its tools; an
  optional ``get_reward()`` becomes one more reward function named after the class (weight 1.0).

Calls: a tool returns anything; its result becomes the tool message's content (``str()``, or JSON for a dict or a
list). Every call of the user's code here (tools, environment methods, building an environment, ``reset``,
``get_reward``) goes through the one place that runs user code, :func:`fsdptrain.rewards.pool.call_user_code`, inside
a stop signal's grace (:func:`fsdptrain.run.signals.user_code`). An unknown tool name, arguments that do not fit, or
a tool that raises an ``Exception`` give the content ``{"error": "..."}`` and count as a failure; a tool or method
that tries to end the process (``sys.exit`` with any status, ``os._exit``, another ``BaseException``) or whose worker
dies stops the run with one line naming it (:class:`ToolError`, exit 2), as a reward function would. A call past
``reward.timeout_s`` is cut off and answered ``{"error": "timed out after ...s"}`` (counted as a failure and as a
timeout): with ``reward.num_workers > 0`` plain tools run in their own worker pool (:mod:`fsdptrain.rewards.pool`,
which imports the tools' files when a worker starts, outside any call's deadline) and a late call is killed with its
worker; in the training process (no workers, and an environment's methods, which run on the sample's own instance
where its state lives) a late call is abandoned on its thread. ``reset`` and building an instance are held to a
reward function's rules: one that raises, returns something other than a string or None, or runs past the timeout
stops the run with one line naming the class and method.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.registry.user_functions import load_callable
from fsdptrain.rewards.pool import Call, Outcome, WorkerPool, WorkerStartError, call_user_code
from fsdptrain.rewards.runner import UserCodeError
from fsdptrain.run.signals import user_code

ENVIRONMENT_REWARD_SPEC = "fsdptrain.rollout.tools:environment_reward"
"""The reward function behind an environment's ``get_reward`` (loadable by spec in reward worker processes)."""


@dataclass(frozen=True)
class Tool:
    """One tool: ``name`` (what the model calls), the ``spec`` it was loaded from (None for an environment's method),
    the function and its JSON schema."""

    name: str
    spec: Optional[str]
    fn: Callable
    schema: dict


@dataclass(frozen=True)
class Environment:
    """An environment class: its name, the class, the names of its tool methods with their schemas, and whether it
    defines ``get_reward``."""

    name: str
    cls: type
    tool_schemas: tuple[dict, ...]
    has_reward: bool

    def tool_names(self) -> list[str]:
        return [s["function"]["name"] for s in self.tool_schemas]


def tool_schema(fn: Callable, *, what: str) -> dict:
    """``fn``'s JSON schema from transformers (``get_json_schema``); ConfigError naming ``what`` and the reason when
    ``fn`` lacks type hints or a Google-style docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers raises its own parsing exceptions; the message names what is missing
        raise ConfigError(f"{what}: {str(err).splitlines()[0]} (a tool needs type hints on every argument and a "
                          f"Google-style docstring with an Args: section)") from None


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """The functions ``rollout.tools`` names, each checked to be a plain function with a schema."""
    tools: list[Tool] = []
    for spec in specs:
        fn = load_callable(spec, what="rollout.tools")
        if not inspect.isfunction(fn):
            raise ConfigError(f"rollout.tools: {spec!r} is a {type(fn).__name__}, not a function")
        schema = tool_schema(fn, what=f"rollout.tools: {spec!r}")
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise ConfigError(f"rollout.tools: two tools are named {name!r}")
        tools.append(Tool(name=name, spec=spec, fn=fn, schema=schema))
    return tools


def load_environment(spec: str) -> Environment:
    """The class ``rollout.environment`` names, checked: a class with ``reset``, whose public methods other than
    ``reset`` and ``get_reward`` are tools with schemas."""
    cls = load_callable(spec, what="rollout.environment")
    if not inspect.isclass(cls):
        raise ConfigError(f"rollout.environment: {spec!r} is a {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"rollout.environment: {spec!r} has no reset method (reset(**row_columns) -> str | None)")
    schemas = []
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        schemas.append(tool_schema(member, what=f"rollout.environment: {spec!r} method {name!r}"))
    for schema in schemas:  # the schema of the unbound function lists self; the model never passes it
        params = schema["function"].get("parameters", {})
        params.get("properties", {}).pop("self", None)
        if "required" in params:
            params["required"] = [r for r in params["required"] if r != "self"]
    return Environment(name=cls.__name__, cls=cls, tool_schemas=tuple(schemas),
                       has_reward=callable(getattr(cls, "get_reward", None)))


def environment_reward(prompts, completions, completion_ids, environments, **kwargs) -> list:
    """The reward function of an environment's ``get_reward``: one value per sample, from its own instance, checked
    as any reward function's values are (fsdptrain/rewards/runner.py; a numpy or torch scalar is its number)."""
    values = [env.get_reward() for env in environments]
    return [v.tolist() if hasattr(v, "tolist") else v for v in values]


class ToolError(UserCodeError):
    """A tool or an environment method failed in a way that stops the run (module docstring); ``str()`` is one
    line naming it."""


def start_episode(environment: Environment, columns: dict, *, row: int, timeout_s: Optional[float]):
    """A new instance of ``environment`` and its first observation (``reset(**columns)``: a string, or None), each
    call through the one place, held to a reward function's rules (:class:`ToolError` naming the class and method,
    ``row`` the prompt's dataset row)."""
    env = _call_environment(f"environment {environment.name!r} (building an instance)", environment.cls, {},
                            row=row, timeout_s=timeout_s)
    what = f"environment method '{environment.name}.reset'"
    observation = _call_environment(what, env.reset, columns, row=row, timeout_s=timeout_s)
    if observation is not None and not isinstance(observation, str):
        raise ToolError(what, row, f"returned {type(observation).__name__} {observation!r:.60}, not a string or None")
    return env, observation


def _call_environment(what: str, fn: Callable, kwargs: dict, *, row: int, timeout_s: Optional[float]):
    with user_code(what):
        outcome = call_user_code(fn, kwargs, timeout_s=timeout_s)
    if outcome.status == "ok":
        return outcome.values
    if outcome.status == "timeout":
        raise ToolError(what, row, f"did not return within reward.timeout_s={timeout_s:g} s")
    cause = f"raised {outcome.message}" if outcome.status == "raised" else f"{outcome.message} (it must return)"
    raise ToolError(what, row, cause, outcome.traceback)


def run_tool_call(fn: Callable, kwargs: dict, *, timeout_s: Optional[float] = None) -> Outcome:
    """A tool call through the one place: ``values`` is ``[content]`` (:func:`tool_content`, made where the tool ran,
    so that any result crosses a worker's pipe). The tool workers' ``run``."""
    return call_user_code(fn, kwargs, then=_content_list, timeout_s=timeout_s)


def _content_list(result) -> list[str]:
    return [tool_content(result)]


def tool_content(result) -> str:
    """A tool's return value as the tool message's content: a string as is, a dict or list as JSON, else
    ``str()``."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def error_content(message: str) -> str:
    return json.dumps({"error": message})


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: which sample's instance it targets (for environment methods), the name and arguments."""

    sample: int
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolResult:
    """The tool message's content, and whether the call failed (unknown tool, bad arguments, raised, timed out)."""

    content: str
    failed: bool
    timed_out: bool = False


class ToolCaller:
    """Runs parsed calls, each under ``timeout_s``: plain tools in the worker pool when one is given (built by
    :func:`tool_pool` from the same ``tools``), else in this process; environment methods on the sample's instance,
    in this process."""

    def __init__(self, tools: Sequence[Tool], *, pool: Optional[WorkerPool], timeout_s: Optional[float]):
        self.tools = {t.name: t for t in tools}
        self.index = {t.name: k for k, t in enumerate(tools)}
        self.pool, self.timeout_s = pool, timeout_s

    def run(self, calls: Sequence[ToolCall], environments: Sequence[object] = ()) -> list[ToolResult]:
        """One result per call, in order; ``environments[call.sample]`` is the instance an environment method runs
        on."""
        results: list[Optional[ToolResult]] = [None] * len(calls)
        pooled: list[int] = []
        for i, call in enumerate(calls):
            env = environments[call.sample] if environments else None
            method = self._environment_method(env, call.name)
            if method is not None:
                results[i] = self._here(f"environment method '{type(env).__name__}.{call.name}'", method,
                                        call.arguments)
            elif call.name not in self.tools:
                results[i] = ToolResult(error_content(f"unknown tool {call.name!r}"), failed=True)
            elif self.pool is None:
                results[i] = self._here(f"tool {call.name!r}", self.tools[call.name].fn, call.arguments)
            else:
                pooled.append(i)
        if pooled:
            names = ", ".join(sorted({repr(calls[i].name) for i in pooled}))
            tools = list(self.tools.values())
            with user_code(f"a call of the tools {names}"), _named_start_errors(tools):  # a stop signal's grace
                outcomes = self.pool.map([Call(self.index[calls[i].name], calls[i].arguments) for i in pooled],
                                         timeout_s=self.timeout_s)
            for i, outcome in zip(pooled, outcomes):
                results[i] = self._result(f"tool {calls[i].name!r}", outcome)
        return results  # type: ignore[return-value]

    def _here(self, what: str, fn: Callable, arguments: dict) -> ToolResult:
        with user_code(what):
            return self._result(what, run_tool_call(fn, arguments, timeout_s=self.timeout_s))

    def _result(self, what: str, outcome: Outcome) -> ToolResult:
        """The model's tool message for ``outcome``, or :class:`ToolError` when the run must stop."""
        if outcome.status == "ok":
            return ToolResult(outcome.values[0], failed=False)
        if outcome.status == "timeout":
            return ToolResult(error_content(f"timed out after {self.timeout_s:g}s"), failed=True, timed_out=True)
        if outcome.status == "raised":
            return ToolResult(error_content(outcome.message), failed=True)
        if outcome.status == "ended":
            raise ToolError(what, None, f"{outcome.message} (a tool returns its result; it must not exit)")
        raise ToolError(what, None, outcome.message)  # its worker died

    @staticmethod
    def _environment_method(env, name: str):
        if env is None or name.startswith("_") or name in ("reset", "get_reward"):
            return None
        method = getattr(env, name, None)
        return method if callable(method) else None


def tool_pool(tools: Sequence[Tool], num_workers: int) -> Optional[WorkerPool]:
    """A worker pool for the plain tools (None when there are none or ``num_workers`` is 0): its workers import the
    tools' files when they start, before any call and outside any call's deadline, as the reward workers do."""
    if num_workers == 0 or not tools:
        return None
    names = ", ".join(repr(t.name) for t in tools)
    with user_code(f"the tool workers' import of {names}"), _named_start_errors(tools):  # a stop signal's grace
        return WorkerPool([t.spec for t in tools], num_workers, run=run_tool_call, label="tool")


@contextlib.contextmanager
def _named_start_errors(tools: Sequence[Tool]) -> Iterator[None]:
    """A tool worker that could not import a tool's file (at start, or a replacement's) is a :class:`ToolError`
    naming the tool."""
    try:
        yield
    except WorkerStartError as err:
        raise ToolError(f"tool {tools[err.function].name!r}", None, str(err)) from None
