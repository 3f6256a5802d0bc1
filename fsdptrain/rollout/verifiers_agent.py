"""A verifiers taskset as the user's agent (docs/agents.md "Environment standards"): :func:`verifiers_agent`.

The ``verifiers`` package (``pip install 'fsdptrain[verifiers]'``, its ``verifiers.v1`` stack) defines an
environment as a ``Taskset`` whose tasks carry a prompt (``TaskData.prompt``, ``system_prompt``) and score a
``Trace`` with their ``@vf.reward`` and ``@vf.metric`` methods. :func:`verifiers_agent` turns one into the
``async def run(client, row)`` that ``rollout.agent`` names: row ``i`` of the data is task ``i`` of the taskset
(:func:`taskset_rows` writes such rows); the trajectory is the turn verifiers' chat harness (its null harness, no
tools) would run, the system prompt and the prompt sent through the session's client; the reply, converted by
verifiers' own chat dialect, ends a ``Trace`` that the task scores offline (``Task.score``), and the agent's reward is
the trace's (``Trace.reward``: the weighted sum of its rewards). The trace's rewards and metrics go to samples.jsonl.

Left out, refused when the adapter is built (a one-line error naming what): tool servers (``Toolset``, MCP),
tasks that need a container or a runtime (``NEEDS_CONTAINER``, their own ``setup`` / ``finalize``, rewards or
metrics taking ``runtime``), judges (a second model), ``@vf.stop`` conditions, multi-agent ``Env`` classes and
verifiers' own harness programs (they run as ``uv`` scripts, which fetch packages, and stream, which the endpoint
refuses), and unbounded tasksets.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from fsdptrain.config import ConfigError


def _require_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("verifiers_agent needs the verifiers package: pip install 'fsdptrain[verifiers]'") from None
    return vf


def task_messages(data: Any) -> list[dict]:
    """The messages a task opens with, as verifiers' chat harness sends them: its system prompt, then its prompt (a
    string is one user message)."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(message_to_wire(m) for m in data.prompt or [])
    return messages


def taskset_rows(taskset: Any) -> list[dict]:
    """The data rows of a taskset, in its order: row ``i`` holds task ``i``'s opening messages as its ``prompt``
    (write them as JSON lines and name the file in ``data.path``)."""
    return [{"prompt": task_messages(task.data)} for task in _tasks(taskset)]


def verifiers_agent(taskset: Any) -> Callable:
    """The ``async def run(client, row)`` that runs and scores row ``i``'s task ``i`` of ``taskset`` (module
    docstring)."""
    tasks = _tasks(taskset)
    for task in tasks:
        _check(task)

    async def run(client, row: dict) -> dict:
        index = row["index"]
        if index >= len(tasks):
            raise ValueError(f"row {index} has no task: the taskset holds {len(tasks)} (taskset_rows writes the data)")
        task = tasks[index]
        messages = task_messages(task.data)
        if row["prompt"] != messages:
            raise ValueError(f"row {index}'s prompt is not task {index}'s opening messages (taskset_rows writes them)")
        completion = await client.chat.completions.create(model="policy", messages=messages)
        trace = _trace(task, messages, completion)
        await task.score(trace)
        return {"reward": trace.reward, "rewards": {k: r.score if r else None for k, r in trace.rewards.items()},
                "metrics": dict(trace.metrics)}

    return run


def _tasks(taskset: Any) -> list:
    vf = _require_verifiers()
    if not isinstance(taskset, vf.Taskset):
        raise ConfigError(f"verifiers_agent: {type(taskset).__name__} is not a verifiers Taskset (verifiers.v1)")
    if not taskset.bounded:
        raise ConfigError(f"verifiers_agent: {type(taskset).__name__} is unbounded; bound it with .take(n)")
    if type(taskset).toolsets(taskset.config):
        raise ConfigError(f"verifiers_agent: {type(taskset).__name__} serves tools (Toolset), which the adapter "
                          f"does not run")
    return list(taskset)


def _check(task: Any) -> None:
    """ConfigError (one line) when the task needs what the adapter does not run (module docstring)."""
    vf = _require_verifiers()
    name = type(task).__name__
    refused = []
    if task.NEEDS_CONTAINER:
        refused.append("a container (NEEDS_CONTAINER)")
    if type(task).toolsets(task.config):
        refused.append("tool servers (Toolset)")
    refused += [f"its own {hook}()" for hook in ("setup", "finalize", "stage_verifier")
                if getattr(type(task), hook) is not getattr(vf.Task, hook)]
    refused += [f"a runtime for {fn.__name__}" for fn in (*task.hooks("reward"), *task.hooks("metric"))
                if _needs_runtime(fn)]
    if task.config.judges:
        refused.append("judges")
    if task.hooks("stop"):
        refused.append("@vf.stop conditions")
    if refused:
        raise ConfigError(f"verifiers_agent: task {name} needs {', '.join(refused)}, which the adapter does not run "
                          f"(docs/agents.md)")


def _needs_runtime(fn: Callable) -> bool:
    """Whether a reward or metric takes a ``runtime`` without a default (``Task.score`` skips those offline)."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _trace(task: Any, messages: list[dict], completion: Any):
    """The trace of one turn: the opening messages, then the sampled reply, as verifiers records them."""
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import parse_message, response_from_wire
    from verifiers.v1.graph import MessageNode

    response = response_from_wire(completion)
    opening = [parse_message(m) for m in messages]
    nodes = [MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(opening)]
    nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=response.message, sampled=True))
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes,
                    calls=[vf.ModelCall(node=len(nodes) - 1, model=completion.model,
                                        finish_reason=response.finish_reason, usage=response.usage)],
                    is_completed=True, ok=True)
