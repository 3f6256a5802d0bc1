"""The environment standards' adapters (fsdptrain/rollout/openenv_agent.py, verifiers_agent.py) against the real
packages and the real endpoint: an OpenEnv environment served by OpenEnv's own server on loopback plays exactly the
episodes it plays in-process; what the adapters do not run is refused in one line naming it."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

import pytest

from fsdptrain.config import ConfigError
from tests.e2e.test_agent_adapters import GUESSES, ROOT, biased_model
from tests.unit.test_agent_endpoint import Served


def example(folder: str, module: str):
    sys.path.insert(0, str(ROOT / "examples" / folder))
    try:
        return __import__(module)
    finally:
        sys.path.remove(str(ROOT / "examples" / folder))


@pytest.fixture(scope="module")
def guessing_model():
    """The e2e tests' tiny model whose likely tokens are EOS and the 8 guesses."""
    return biased_model(GUESSES, GUESSES)


def play(served: Served, run, rows: list[dict]) -> list:
    """Every row's episode at once, each through its own session of ``served``, as the agent runner runs them."""
    import openai

    async def all_rows():
        clients = [openai.AsyncOpenAI(base_url=served.endpoint.base_url(s), api_key=served.endpoint.key, max_retries=0)
                   for s in served.sessions]
        try:
            return await asyncio.gather(*(run(c, row) for c, row in zip(clients, rows)))
        finally:
            for c in clients:
                await c.close()

    try:
        return asyncio.run(all_rows())
    finally:
        served.stop()


class OpenEnvServer:
    """examples/openenv/guess.py behind OpenEnv's own FastAPI app (``create_fastapi_app``) on a loopback port."""

    def __init__(self):
        import uvicorn
        from openenv.core.env_server import create_fastapi_app

        guess = example("openenv", "guess")
        app = create_fastapi_app(guess.GuessEnvironment, guess.GuessAction, guess.GuessObservation,
                                 max_concurrent_envs=8)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            threading.Event().wait(0.05)
        assert self.server.started

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def test_openenv_a_served_environment_plays_the_episodes_it_plays_in_process(guessing_model):
    pytest.importorskip("openenv")
    pytest.importorskip("uvicorn")
    from openenv.core.generic_client import GenericEnvClient

    from fsdptrain.rollout.openenv_agent import openenv_agent

    guess = example("openenv", "guess")
    model, tokenizer = guessing_model
    rows = [{"prompt": [{"role": "user", "content": "Find the secret number."}], "index": k} for k in range(8)]
    local = play(Served(model, tokenizer, 8, max_new_tokens=160),
                 openenv_agent(guess.GuessEnvironment, action=guess.GuessAction), rows)
    server = OpenEnvServer()
    try:
        remote_run = openenv_agent(client=lambda: GenericEnvClient(base_url=f"http://127.0.0.1:{server.port}"),
                                   action=guess.GuessAction)
        remote = play(Served(model, tokenizer, 8, max_new_tokens=160), remote_run, rows)
    finally:
        server.stop()
    assert remote == local
    assert any(r["reward"] == 1.0 for r in local) and any(len(r["step_rewards"]) >= 2 for r in local)
    for row, result in zip(rows, local):  # the reward is the sum of the steps' (1 for the right guess, then done)
        assert result["reward"] == sum(result["step_rewards"]) and result["step_rewards"][:-1] == [0.0] * (
            len(result["step_rewards"]) - 1)


def test_openenv_what_the_adapter_cannot_run_is_refused_in_one_line():
    pytest.importorskip("openenv")
    from fsdptrain.rollout.openenv_agent import openenv_agent

    guess = example("openenv", "guess")
    with pytest.raises(ConfigError, match="exactly one of env= .* or client="):
        openenv_agent(guess.GuessEnvironment, action=guess.GuessAction, client=lambda: None)
    with pytest.raises(ConfigError, match="action=<class 'int'> is not an openenv Action class"):
        openenv_agent(guess.GuessEnvironment, action=int)


VERIFIERS_REFUSED = '''
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str = ""


class NeedsRuntime(vf.Task[Data]):
    @vf.reward
    async def ran(self, trace, runtime) -> float:
        return 1.0


class Stops(vf.Task[Data]):
    @vf.stop
    async def early(self, trace) -> bool:
        return True


class Boxed(vf.Task[Data]):
    NEEDS_CONTAINER = True

    async def setup(self, trace, runtime):
        pass


def taskset(task_type):
    class One(vf.Taskset[task_type]):
        def load(self):
            yield task_type(Data(prompt="Hi"))

    return One(vf.TasksetConfig())
'''


@pytest.mark.parametrize("task, want", [
    ("NeedsRuntime", "task NeedsRuntime needs a runtime for ran, which the adapter does not run (docs/agents.md)"),
    ("Stops", "task Stops needs @vf.stop conditions,"),
    ("Boxed", "task Boxed needs a container (NEEDS_CONTAINER), its own setup(),")])
def test_verifiers_what_the_adapter_cannot_run_is_refused_in_one_line(tmp_path, task, want):
    pytest.importorskip("verifiers.v1")
    from fsdptrain.registry.user_functions import load_file
    from fsdptrain.rollout.verifiers_agent import verifiers_agent

    (tmp_path / "tasks.py").write_text(VERIFIERS_REFUSED)
    module = load_file(tmp_path / "tasks.py", spec="tasks.py:taskset", what="test")
    with pytest.raises(ConfigError) as err:
        verifiers_agent(module.taskset(getattr(module, task)))
    assert want in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="verifiers_agent: list is not a verifiers Taskset"):
        verifiers_agent([])


def test_verifiers_a_row_that_is_not_its_task_stops_the_agent_before_any_request():
    pytest.importorskip("verifiers.v1")
    import verifiers.v1 as vf

    from fsdptrain.rollout.verifiers_agent import taskset_rows, verifiers_agent

    taskset = example("verifiers", "arith").SumTaskset(vf.TasksetConfig())
    rows = taskset_rows(taskset)
    assert len(rows) == 25 and rows[7]["prompt"] == [{"role": "system", "content": "Answer with the number only."},
                                                      {"role": "user", "content": "What is 1+2?"}]
    run = verifiers_agent(taskset)
    with pytest.raises(ValueError, match="row 7's prompt is not task 7's opening messages"):
        asyncio.run(run(None, {"index": 7, "prompt": rows[8]["prompt"]}))
    with pytest.raises(ValueError, match="row 25 has no task: the taskset holds 25"):
        asyncio.run(run(None, {"index": 25, "prompt": rows[0]["prompt"]}))
