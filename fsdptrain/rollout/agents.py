"""The user's agent as the sampler (``rollout.agent=path.py:run``, docs/agents.md): :class:`AgentSampler`.

Each sample is one trajectory of one agent: ``async def run(client, row)`` gets an ``openai.AsyncOpenAI`` client
bound to the trajectory's session on the endpoint (fsdptrain/rollout/endpoint.py) and the dataset row (its
``prompt`` as messages, and its other columns), and returns its reward: a number, a dict whose ``reward`` is that
number (its other keys go to samples.jsonl), or None (the reward functions and models score the trajectory). Every
agent of this rank runs at once on one event loop; their requests reach the run's decoder as they come and are
decoded in one continuous loop. A turn's seed is its ``row_seed`` (sample, turn), so the tokens are the same on any
number of ranks.

The agents' calls follow the rules of the one place that runs user code
(:func:`fsdptrain.rewards.pool.call_user_code`): an agent that raises, or tries to end the process (``sys.exit``,
``os._exit``, a ``BaseException``), stops the run with one line naming it and the row (:class:`AgentError`, exit 2); one running
past ``reward.timeout_s`` is cancelled, its session closed, and its reward is ``reward.timeout_score``
(``agents/num_timed_out``); a reward that is not a finite number or None stops the run as a reward function's would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import numbers
import threading
from typing import Callable, Optional

from omegaconf import DictConfig

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import ChatTurns, render_ids_as_data
from fsdptrain.data.prompts import PromptRow
from fsdptrain.generation.decoder import Decoder, SampleMode, sampling_for
from fsdptrain.generation.seeds import eval_sample_seed, eval_turn_seed, row_seed
from fsdptrain.metrics.typed import Max, Mean, Metrics, Sum
from fsdptrain.registry.user_functions import load_callable
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.rewards.pool import Outcome, call_user_code, exits_raise_on_this_thread
from fsdptrain.rewards.runner import UserCodeError
from fsdptrain.rollout.endpoint import Endpoint, Session
from fsdptrain.rollout.sampler import Samples
from fsdptrain.run.signals import user_code

AGENT_REWARD = "agent"
"""The reward the agents' return values are (weight 1.0)."""
AGENT_REWARD_SPEC = "fsdptrain.rollout.agents:agent_reward"


def agent_reward(prompts, completions, completion_ids, agent_rewards, **kwargs) -> list:
    """The reward function of the agents' return values (None: the agent gave none)."""
    return list(agent_rewards)


class AgentError(UserCodeError):
    """An agent failed in a way that stops the run (module docstring)."""


def load_agent(spec: str) -> Callable:
    """The ``async def run(client, row)`` that ``rollout.agent`` names (ConfigError, one line)."""
    fn = load_callable(spec, what="rollout.agent")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rollout.agent: {spec!r} is not an async function (async def run(client, row) -> reward)")
    return fn


def check_agent(cfg: DictConfig) -> None:
    """What the CLI checks before any rank starts: the agent loads, the openai package is installed, and the
    tokenizer's chat template renders tools and is prefix-preserving."""
    from fsdptrain.model.loading import build_tokenizer

    load_agent(cfg.rollout.agent)
    _openai()
    _chat_turns(build_tokenizer(cfg))


def _openai():
    try:
        import openai
    except ImportError:
        raise ConfigError("rollout.agent needs the openai package: pip install 'fsdptrain[agents]'") from None
    return openai


def _chat_turns(tokenizer) -> ChatTurns:
    try:
        return ChatTurns(tokenizer, [])
    except ConfigError as err:
        raise ConfigError(f"rollout.agent: {str(err).split(': ', 1)[-1]}") from None


def _shared_http_client():
    """One HTTP client for every agent of a sampling call. Each ``openai.AsyncOpenAI`` would otherwise build its own,
    and building one (its TLS context) costs about 20 ms of CPU: with 64 agents, more than the whole step's decode
    (docs/agents.md, "Throughput"). An agent closing its client (``async with client``, ``client.close()``) closes
    nothing the others use: the runner closes it when the sampling call ends."""
    openai = _openai()

    class SharedHttpClient(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            pass

        async def close_shared(self) -> None:
            await super().aclose()

    return SharedHttpClient()


class _AgentRunner:
    """The agents of one sampling call, on one event loop thread; each awaited through ``call_user_code`` on a
    thread of its own (which only waits), so that its outcome follows the one place's rules."""

    def __init__(self, fn: Callable, timeout_s: Optional[float]):
        self.fn, self.timeout_s = fn, timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="fsdptrain-agents")
        self.thread.start()
        self.waiters: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.http = _shared_http_client()

    def _serve(self) -> None:
        with exits_raise_on_this_thread():  # an agent's os._exit is its outcome, not the end of the run
            self.loop.run_forever()

    def start(self, jobs: list[tuple[Session, str, str, dict]]) -> list[concurrent.futures.Future]:
        """One future of an :class:`Outcome` per ``(session, base_url, key, row)``."""
        self.waiters = concurrent.futures.ThreadPoolExecutor(max(1, len(jobs)), thread_name_prefix="agent-wait")
        return [self.waiters.submit(self._one, *job) for job in jobs]

    def _one(self, session: Session, base_url: str, key: str, row: dict) -> Outcome:
        task: list[concurrent.futures.Future] = []
        try:
            outcome = call_user_code(self._await, {"base_url": base_url, "key": key, "row": row, "task": task},
                                     timeout_s=self.timeout_s)
            if outcome.status == "timeout" and task:
                task[0].cancel()
            return outcome
        finally:
            session.finish()

    def _await(self, base_url: str, key: str, row: dict, task: list):
        task.append(asyncio.run_coroutine_threadsafe(self._guarded(base_url, key, row), self.loop))
        ok, value = task[0].result()
        if not ok:
            raise value
        return value

    async def _guarded(self, base_url: str, key: str, row: dict):
        client = _openai().AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=None,
                                       http_client=self.http)
        try:
            return True, await self.fn(client, row)
        except BaseException as err:  # noqa: BLE001 -- classified by call_user_code in the waiting thread
            return False, err
        finally:
            await client.close()

    def close(self) -> None:
        if self.waiters is not None:
            self.waiters.shutdown(wait=False, cancel_futures=True)
        closing = asyncio.run_coroutine_threadsafe(self.http.close_shared(), self.loop)
        try:
            closing.result(timeout=5)
        except (concurrent.futures.TimeoutError, OSError, RuntimeError):
            pass  # connections of agents cancelled mid-request; the endpoint has shut them already
        self.loop.call_soon_threadsafe(self.loop.stop)


class AgentSampler:
    """Samples that the user's agent drives through the endpoint; see the module docstring."""

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.spec = cfg.rollout.agent
        self.fn = load_agent(self.spec)
        _openai()
        self.chat = _chat_turns(tokenizer)
        self.last_endpoint: Optional[Endpoint] = None
        """The last sampling call's endpoint (stopped): its ports and its per-request seconds, for tests and
        benchmarks/agents.py."""

    def reward_functions(self, functions: list[RewardFunction]) -> list[RewardFunction]:
        if any(f.name == AGENT_REWARD for f in functions):
            raise ConfigError(f"rollout.agent: its return value is the reward {AGENT_REWARD!r}, which "
                              f"reward.functions already names")
        return [*functions, RewardFunction(name=AGENT_REWARD, spec=AGENT_REWARD_SPEC, fn=agent_reward, weight=1.0)]

    def describe(self) -> str:
        r = self.cfg.rollout
        return f"; agent {self.spec} on a loopback OpenAI endpoint; up to {r.max_turns} turns in {r.max_new_tokens} " \
               f"response tokens"

    def close(self) -> None:
        pass

    def sample(self, decoder: Decoder, groups: list[tuple[int, PromptRow]], *, repeat: int, mode: SampleMode,
               step: int, round_index: int, rank: int) -> Samples:
        seed, r = self.cfg.trainer.seed, self.cfg.rollout
        sessions, rows = [], []
        for group, row in groups:
            for s in range(repeat):
                sessions.append(Session(len(sessions), _seeds(mode, seed, step, group, s, round_index),
                                        max_new_tokens=r.max_new_tokens, max_turns=r.max_turns))
                rows.append(row)
        runner = _AgentRunner(self.fn, self.cfg.reward.timeout_s)
        try:
            with Endpoint(sessions, self.tokenizer, sampling_for(self.cfg, mode)) as endpoint:
                self.last_endpoint = endpoint
                jobs = [(s, endpoint.base_url(s), endpoint.key, _row_argument(row)) for s, row in zip(sessions, rows)]
                with decoder.generating(uneven=True), user_code(f"the agent {self.spec!r}"):
                    outcomes = runner.start(jobs)
                    decoder.decode(endpoint.requests(), sampling_for(self.cfg, mode), on_finish=endpoint.on_finish)
                    results = [f.result() for f in outcomes]
        finally:
            runner.close()
        return self._samples(sessions, rows, results)

    def _samples(self, sessions: list[Session], rows: list[PromptRow], outcomes: list[Outcome]) -> Samples:
        rewards, infos = [], []
        for session, row, outcome in zip(sessions, rows, outcomes):
            reward, info = self._reward(outcome, row)
            rewards.append(reward)
            infos.append(info)
        trained = [self._trained(s, row) for s, row in zip(sessions, rows)]
        texts = [self.tokenizer.decode(seg.response_ids, skip_special_tokens=False) for seg in trained]
        completions = [seg.messages[seg.num_prompt_messages:] for seg in trained]
        return Samples(
            prompt_ids=[seg.prompt_ids for seg in trained], response_ids=[seg.response_ids for seg in trained],
            truncated=[s.truncation is not None for s in sessions], prompts=[seg.prompt_text for seg in trained],
            completions=completions, response_texts=texts,
            answers=[next((m["content"] or "" for m in reversed(c) if m["role"] == "assistant"), "")
                     for c in completions],
            response_masks=[list(seg.response_mask) for seg in trained],
            generation_logprobs=[list(seg.logprobs) for seg in trained],
            conversations=[list(seg.messages) for seg in trained],
            columns={"agent_rewards": rewards},
            details=[{"turns": seg.messages[seg.num_prompt_messages:], "truncated": s.truncation,
                      "segments": [{"prompt_tokens": len(g.prompt_ids), "response_tokens": len(g.response_ids),
                                    "sampled_tokens": g.num_sampled, "turns": g.num_turns} for g in s.segments],
                      **({"agent": info} if info is not None else {})}
                     for s, seg, info in zip(sessions, trained, infos)],
            metrics=agent_metrics(sessions, outcomes))

    def _trained(self, session: Session, row: PromptRow):
        """The session's trained segment; an agent that made no request gives its row's prompt and one EOS that
        trains nothing (mask 0)."""
        if session.segments:
            return session.trained()
        from fsdptrain.rollout.endpoint import Segment

        messages = row.chat()
        ids = render_ids_as_data(self.tokenizer, messages, tools=None, add_generation_prompt=True)
        return Segment(prompt_ids=ids, messages=messages, num_prompt_messages=len(messages),
                       prompt_text=self.tokenizer.decode(ids, skip_special_tokens=False),
                       response_ids=[self.tokenizer.eos_token_id], response_mask=[0], logprobs=[0.0])

    def _reward(self, outcome: Outcome, row: PromptRow):
        """The agent's reward and the rest of what it returned; AgentError when it raised or tried to exit."""
        what = f"agent {self.spec!r}"
        if outcome.status == "timeout":
            return float(self.cfg.reward.timeout_score), {"timed_out": self.cfg.reward.timeout_s}
        if outcome.status == "raised":
            raise AgentError(what, row.index, f"raised {outcome.message}", outcome.traceback)
        if outcome.status != "ok":
            raise AgentError(what, row.index, f"{outcome.message} (an agent returns its reward; it must not exit)")
        value = outcome.values
        info = None
        if isinstance(value, dict):
            info = json.loads(json.dumps({k: v for k, v in value.items() if k != "reward"}, default=repr))
            value = value.get("reward")
        if hasattr(value, "tolist"):
            value = value.tolist()
        if value is not None and not isinstance(value, numbers.Real):
            raise AgentError(what, row.index, f"returned {type(value).__name__} {value!r:.60}, not a number, a dict "
                                              f"with a reward, or None")
        return value, info


def _seeds(mode: SampleMode, seed: int, step: int, group: int, sample: int, round_index: int):
    """``turn -> seed`` of one trajectory (fsdptrain/generation/seeds.py): training, its ``row_seed``; the sampled
    evaluation, its ``eval_turn_seed``; greedy, none."""
    if mode == "train":
        return lambda turn: row_seed(seed, step, group, sample, round_index, turn)
    if mode == "eval":
        return lambda turn: eval_turn_seed(eval_sample_seed(seed, step, group, sample), turn)
    return lambda turn: None


def _row_argument(row: PromptRow) -> dict:
    """The row an agent receives: its prompt as messages, its index and its other columns."""
    return {"prompt": row.chat(), "index": row.index, **row.columns}


def agent_metrics(sessions: list[Session], outcomes: list[Outcome]) -> Metrics:
    """This rank's agent metrics, each a SUM, MEAN or MAX of per-trajectory counts (docs/agents.md):

    - ``agents/requests/mean`` (MEAN), ``agents/requests/max`` (MAX): completion requests per trajectory;
    - ``agents/segments/mean`` (MEAN): segments per trajectory (more than 1: the agent edited its history);
    - ``agents/untrained_tokens`` (SUM): sampled tokens of segments before the trained (last) one;
    - ``agents/num_timed_out`` (SUM): agents cancelled at ``reward.timeout_s``; ``agents/num_refused`` (SUM):
      requests answered empty because the trajectory's budget was spent;
    - ``turns/mean`` (MEAN), ``turns/max`` (MAX): completions sampled per trajectory;
    - ``truncated/<cause>`` (MEAN): the share of trajectories truncated by ``length``, ``max_turns`` or
      ``tool_overflow``.
    """
    num = len(sessions)
    requests = [s.num_requests for s in sessions]
    out = {
        "agents/requests/mean": Mean(sum(requests), num),
        "agents/requests/max": Max(max(requests)) if requests else Max(),
        "agents/segments/mean": Mean(sum(len(s.segments) for s in sessions), num),
        "agents/untrained_tokens": Sum(sum(g.num_sampled for s in sessions for g in s.segments[:-1])),
        "agents/num_timed_out": Sum(sum(o.status == "timeout" for o in outcomes)),
        "agents/num_refused": Sum(sum(s.num_refused for s in sessions)),
        "turns/mean": Mean(sum(s.num_turns for s in sessions), num),
        "turns/max": Max(max(s.num_turns for s in sessions)) if sessions else Max(),
    }
    for cause in ("length", "max_turns", "tool_overflow"):
        out[f"truncated/{cause}"] = Mean(sum(s.truncation == cause for s in sessions), num)
    return Metrics(out)
