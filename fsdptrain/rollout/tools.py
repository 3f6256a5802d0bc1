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
list). An unknown tool name, arguments that do not fit, or a raising tool give the content
``{"error": "..."}`` and count as a failure. With ``reward.num_workers > 0`` plain tools run in the reward worker
pool (:mod:`fsdptrain.rewards.pool`) under ``reward.timeout_s``: a call past it is cut off and answered
``{"error": "timed out after ...s"}`` (counted as a failure and as a timeout). An environment's methods always run in
the training process, on the sample's own instance (its state lives there), and cannot be cut off.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.registry.user_functions import load_callable
from fsdptrain.rewards.pool import Call, WorkerPool

ENVIRONMENT_REWARD_SPEC = "fsdptrain.rollout.tools:environment_reward"
"""The reward function behind an environment's ``get_reward`` (loadable by spec in reward worker processes)."""
TOOL_CALL_SPEC = "fsdptrain.rollout.tools:call_tool_by_spec"
"""The function the worker pool runs for a tool call: it loads the tool by spec and calls it."""


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


def environment_reward(prompts, completions, completion_ids, environments, **kwargs) -> list[float]:
    """The reward function of an environment's ``get_reward``: one value per sample, from its own instance."""
    return [float(env.get_reward()) for env in environments]


def call_tool_by_spec(spec: str, arguments: dict) -> list:
    """Run in a reward worker: load the tool ``spec`` (cached per process) and call it; ``[content]``, the list the
    pool expects. A raising tool raises here (the pool reports it)."""
    return [tool_content(load_callable(spec, what="rollout.tools")(**arguments))]


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
    """Runs parsed calls: plain tools in the worker pool when one is given (under ``timeout_s``), else in this
    process; environment methods on the sample's instance, in this process."""

    def __init__(self, tools: Sequence[Tool], *, pool: Optional[WorkerPool], timeout_s: Optional[float]):
        self.tools = {t.name: t for t in tools}
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
                results[i] = _call_here(method, call.arguments)
            elif call.name not in self.tools:
                results[i] = ToolResult(error_content(f"unknown tool {call.name!r}"), failed=True)
            elif self.pool is None:
                results[i] = _call_here(self.tools[call.name].fn, call.arguments)
            else:
                pooled.append(i)
        if pooled:
            outcomes = self.pool.map([Call(0, {"spec": self.tools[calls[i].name].spec, "arguments": calls[i].arguments})
                                      for i in pooled], timeout_s=self.timeout_s)
            for i, outcome in zip(pooled, outcomes):
                if outcome.status == "ok":
                    results[i] = ToolResult(str(outcome.values[0]), failed=False)
                elif outcome.status == "timeout":
                    results[i] = ToolResult(error_content(f"timed out after {self.timeout_s:g}s"), failed=True,
                                            timed_out=True)
                else:
                    results[i] = ToolResult(error_content(outcome.message), failed=True)
        return results  # type: ignore[return-value]

    @staticmethod
    def _environment_method(env, name: str):
        if env is None or name.startswith("_") or name in ("reset", "get_reward"):
            return None
        method = getattr(env, name, None)
        return method if callable(method) else None


def _call_here(fn: Callable, arguments: dict) -> ToolResult:
    try:
        return ToolResult(tool_content(fn(**arguments)), failed=False)
    except Exception as err:  # the tool's own failure becomes the model's error message
        return ToolResult(error_content(f"{type(err).__name__}: {err}"), failed=True)


def tool_pool(tools: Sequence[Tool], num_workers: int) -> Optional[WorkerPool]:
    """A worker pool for the plain tools (None when there are none or ``num_workers`` is 0)."""
    if num_workers == 0 or not tools:
        return None
    return WorkerPool([TOOL_CALL_SPEC], num_workers)
