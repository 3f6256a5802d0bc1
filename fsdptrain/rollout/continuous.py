"""``rollout.engine=continuous``: the samplers' rollouts through :class:`fsdptrain.generation.continuous.ContinuousEngine`
(docs/rollout.md).

Single-turn: every sample of this rank's groups is one request, each prompt's shared part prefilled once. Multi-turn:
every trajectory of this rank (all groups) is in the one decode loop; a turn that calls tools leaves the batch, its
calls run on a tool thread (through :class:`fsdptrain.rollout.tools.ToolCaller`: the worker pool, ``reward.timeout_s``
and the counting of ``tools/*`` as with ``generate``) while the other rows decode, and the trajectory re-enters with
only its new tokens (the turn's last sampled id, then the tool messages and the template's separators) prefilled
onto its kept cache. The turn logic is :func:`fsdptrain.rollout.turns.finish_turn` and
:func:`~fsdptrain.rollout.turns.append_tool_results`, the same as ``run_turns``'s.

Every sample draws from its own generator (:func:`row_seed`: trainer.seed, step, the group's global index, the
sample, the round and the turn), so its tokens never depend on the rank, the world size or the other rows. Ranks run
different numbers of forwards, so the policy's weights are always gathered for the block (as multi-turn does).
"""

from __future__ import annotations

import concurrent.futures
import random
from typing import Callable, Optional, Sequence

from fsdptrain.data.conversation import ChatTurns
from fsdptrain.generation.continuous import ContinuousEngine, Finished, Request
from fsdptrain.rollout.turns import Trajectory, TurnCaps, append_tool_results, finish_turn


def row_seed(seed: int, step: int, group: int, sample: int, round_index: int, turn: int) -> int:
    """The training seed of one sample's turn under the continuous engine: where it is in the run, never the rank."""
    return random.Random(f"row:{seed}:{step}:{group}:{sample}:{round_index}:{turn}").getrandbits(62)


def make_engine(model, cfg, tokenizer, *, temperature: float, top_p: float) -> ContinuousEngine:
    rollout = cfg.rollout
    return ContinuousEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                            temperature=temperature, top_p=top_p, max_live_rows=rollout.max_live_rows,
                            max_live_tokens=rollout.max_live_tokens)


def generate_continuous(engine: ContinuousEngine, prompts: Sequence[list[int]], seeds: Sequence[Optional[int]], *,
                        max_new_tokens: int) -> list[tuple[list[int], list[int], bool, list[float]]]:
    """``(prompt_ids, response_ids, truncated, generation_logprobs)`` per prompt, in order (seed None: greedy); the
    log-probs are the engine's (after temperature, before top-p), on-policy (``Rollout.generation_logprobs``)."""
    finished = {f.key: f for f in engine.run([Request(i, list(p), max_new_tokens, seed=s)
                                              for i, (p, s) in enumerate(zip(prompts, seeds))])}
    return [(list(p), finished[i].new_ids, not finished[i].ended, finished[i].logprobs)
            for i, p in enumerate(prompts)]


CallTools = Callable[[list[tuple[int, str, dict]]], list]
"""``call_tools([(sample, name, arguments)]) -> [result]``, as :func:`fsdptrain.rollout.turns.run_turns` takes it."""


def run_turns_continuous(engine: ContinuousEngine, chat: ChatTurns, prompts: Sequence[list[int]], *,
                         seed: Callable[[int, int], Optional[int]], call_tools: CallTools,
                         caps: TurnCaps) -> list[Trajectory]:
    """The trajectories of ``prompts``, every turn of every one in the engine's one loop; ``seed(sample, turn)`` is
    a turn's seed (None: greedy). What a trajectory becomes is what ``run_turns`` makes of the same turns."""
    trajectories = [Trajectory(prompt_ids=list(p)) for p in prompts]

    def request(sample: int, new_ids: list[int], finished: Optional[Finished]) -> Request:
        t = trajectories[sample]
        return Request(sample, new_ids, caps.max_new_tokens - len(t.response_ids), seed=seed(sample, t.num_turns),
                       kept=finished.kept if finished else None, keep=t.num_turns + 1 < caps.max_turns)

    tool_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tools")

    def after_tools(calling: list[tuple[Finished, list[tuple[str, dict]]]]) -> list[Request]:
        """One step's tool calls, run together as ``run_turns`` runs a turn's; the trajectories' next turns."""
        results = iter(call_tools([(f.key, name, arguments) for f, calls in calling for name, arguments in calls]))
        follow = []
        for finished, calls in calling:
            t = trajectories[finished.key]
            before = len(t.response_ids)
            append_tool_results(chat, t, calls, [next(results) for _ in calls], caps)
            if not t.done:
                follow.append(request(finished.key, finished.new_ids[-1:] + t.response_ids[before:], finished))
        return follow

    def on_finish(finished_rows: list[Finished]) -> list:
        calling = []
        for finished in finished_rows:
            t = trajectories[finished.key]
            calls = finish_turn(chat, t, finished.new_ids, finished.ended, budget=len(finished.new_ids),
                                last_turn=t.num_turns == caps.max_turns - 1)
            if calls:
                calling.append((finished, calls))
        # one task per step, not per row: each hand-over to the tool thread costs the decode loop a GIL switch
        return [tool_thread.submit(after_tools, calling)] if calling else []

    # Not a `with` block: leaving on an exception (a stop signal's grace ran out, a ToolError) must not wait for a
    # tool call that may never return (fsdptrain/run/signals.py); the process leaves through os._exit anyway.
    try:
        engine.run([request(i, t.prompt_ids, None) for i, t in enumerate(trajectories)], on_finish)
    except BaseException:
        tool_thread.shutdown(wait=False, cancel_futures=True)
        raise
    tool_thread.shutdown()
    return trajectories

