"""An OpenEnv environment as the user's agent (docs/agents.md "Environment standards"): :func:`openenv_agent`.

The ``openenv-core`` package (``pip install 'fsdptrain[openenv]'``) defines an environment as ``reset()`` and
``step(action)``, each returning an observation that carries its ``reward`` and ``done``; an ``Action`` is a pydantic
model. :func:`openenv_agent` turns one into the ``async def run(client, row)`` that ``rollout.agent`` names:

- ``reset`` gets ``seed=row["index"]`` and the row's other columns, those its signature accepts (OpenEnv's HTTP
  server filters the same way), so the samples of one prompt play the same episode;
- the model sees the row's prompt, then the reset observation as a user message, and one tool, ``step``, whose
  parameters are the action's JSON schema;
- each ``step`` call the model makes is validated into the action and stepped; the observation comes back as the
  tool's message; a call that is not ``step`` or fails validation is answered with an error and never reaches the
  environment;
- the episode ends when an observation says ``done``, when the model answers without a call, or when the
  trajectory's budget is spent (the endpoint answers empty); its reward is the sum of the steps' rewards (None
  counts 0).

Observations are shown as the JSON of their fields less ``reward``, ``done`` and ``metadata`` (what OpenEnv's server
sends a client), unless ``observation_text`` says otherwise. The environment runs in the rank's process (``env``: a
callable returning an ``Environment``, one per trajectory) or behind a client of a server you run (``client``: a
callable returning an unconnected ``EnvClient``). Left out: OpenEnv's MCP tool environments (``CallToolAction``),
its experimental harness (``openenv.core.harness``), and containers or Spaces started by the adapter (no network
while training).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Callable, Optional

from fsdptrain.config import ConfigError

STEP_TOOL = "step"
"""The name of the one tool the model acts through."""


def _require_openenv():
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action
    except ImportError:
        raise ConfigError("openenv_agent needs the openenv-core package: pip install 'fsdptrain[openenv]'") from None
    return Environment, Action


def default_observation_text(observation: dict) -> str:
    """An observation as the model reads it: its fields as JSON (keys sorted)."""
    return json.dumps(observation, sort_keys=True, default=str)


def action_tool(action: type, name: str = STEP_TOOL) -> dict:
    """The OpenAI tool of an ``Action`` class: its docstring and its JSON schema less ``metadata``."""
    schema = action.model_json_schema()
    schema["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    schema.pop("title", None)
    description = " ".join((action.__doc__ or f"Act in the environment with a {action.__name__}.").split())
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def reset_arguments(row: dict) -> dict:
    """What ``reset`` is offered: ``seed`` is the row's index, then the row's columns (not its prompt)."""
    return {"seed": row["index"], **{k: v for k, v in row.items() if k not in ("prompt", "index", "seed")}}


def openenv_agent(env: Optional[Callable[[], Any]] = None, *, action: type, client: Optional[Callable[[], Any]] = None,
                  observation_text: Callable[[dict], str] = default_observation_text,
                  reset: Callable[[dict], dict] = reset_arguments) -> Callable:
    """The ``async def run(client, row)`` that plays one episode of the environment per trajectory (module
    docstring). ``env`` (in-process) or ``client`` (a server you run), exactly one; ``action`` is the environment's
    ``Action`` class; ``reset(row)`` gives the keyword arguments offered to ``reset``."""
    environment_type, action_type = _require_openenv()
    if (env is None) == (client is None):
        raise ConfigError("openenv_agent: give exactly one of env= (an Environment factory) or client= (an EnvClient "
                          "factory)")
    if not (isinstance(action, type) and issubclass(action, action_type)):
        raise ConfigError(f"openenv_agent: action={action!r} is not an openenv Action class")
    tools = [action_tool(action)]
    episode = _InProcess(env, environment_type) if env is not None else _Remote(client)

    async def run(model, row: dict) -> dict:
        async with episode.open() as session:
            first = await session.reset(reset(row))
            messages = [*row["prompt"], {"role": "user", "content": observation_text(first["observation"])}]
            rewards, done = [], first["done"]
            while not done:
                reply = await model.chat.completions.create(model="policy", messages=messages, tools=tools)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    text, result = await _act(session, action, call, observation_text)
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": text})
                    if result is not None:
                        rewards.append(result["reward"])
                        done = result["done"]
                    if done:
                        break
        return {"reward": float(sum(r or 0.0 for r in rewards)), "step_rewards": rewards, "done": done}

    return run


async def _act(session, action: type, call, observation_text: Callable[[dict], str]) -> tuple[str, Optional[dict]]:
    """One tool call: ``(tool message, step result)``; a call that cannot be an action gives no step result."""
    if call.function.name != STEP_TOOL:
        return f"error: unknown tool {call.function.name!r}; the tool is {STEP_TOOL!r}", None
    try:
        arguments = json.loads(call.function.arguments or "{}")
        act = action.model_validate(arguments)
    except ValueError as err:  # json.JSONDecodeError and pydantic's ValidationError are ValueErrors
        return f"error: invalid {action.__name__}: {' '.join(str(err).split())}", None
    result = await session.step(act)
    return observation_text(result["observation"]), result


class _InProcess:
    """Episodes of an ``Environment`` built in this process, one instance per episode."""

    def __init__(self, factory: Callable[[], Any], environment_type: type):
        self.factory, self.environment_type = factory, environment_type

    def open(self) -> "_InProcessSession":
        env = self.factory()
        if not isinstance(env, self.environment_type):
            raise TypeError(f"openenv_agent: env() returned {type(env).__name__}, not an openenv Environment")
        return _InProcessSession(env, self.environment_type)


class _InProcessSession:
    """One in-process episode, called as OpenEnv's server calls it: an overridden ``reset_async`` / ``step_async``
    is awaited, a synchronous one runs on a worker thread so that the other agents are not held up."""

    def __init__(self, env, environment_type: type):
        self.env, self.base = env, environment_type

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.env.close()

    async def reset(self, arguments: dict) -> dict:
        return _result(await self._call("reset", **arguments))

    async def step(self, act) -> dict:
        return _result(await self._call("step", act))

    async def _call(self, name: str, *args, **kwargs):
        overridden = getattr(type(self.env), f"{name}_async") is not getattr(self.base, f"{name}_async")
        fn = getattr(self.env, f"{name}_async" if overridden else name)
        kwargs = _accepted(fn, kwargs)
        return await fn(*args, **kwargs) if overridden else await asyncio.to_thread(fn, *args, **kwargs)


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The keyword arguments ``fn`` accepts (all of them when it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _result(observation) -> dict:
    """An observation as OpenEnv's server sends it (``serialize_observation``)."""
    from openenv.core.env_server.serialization import serialize_observation

    return serialize_observation(observation)


class _Remote:
    """Episodes behind an ``EnvClient`` (one connection per episode) of a server you run."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory

    def open(self) -> "_RemoteSession":
        return _RemoteSession(self.factory())


class _RemoteSession:
    def __init__(self, env):
        self.env = env

    async def __aenter__(self):
        await self.env.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.env.close()

    async def reset(self, arguments: dict) -> dict:
        return _step_result(await self.env.reset(**arguments))

    async def step(self, act) -> dict:
        return _step_result(await self.env.step(act))


def _step_result(result) -> dict:
    """A client's ``StepResult`` as the dict the in-process path gives."""
    observation = result.observation
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump(exclude={"reward", "done", "metadata"})
    return {"observation": observation, "reward": result.reward, "done": result.done}
