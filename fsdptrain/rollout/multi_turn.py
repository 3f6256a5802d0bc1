"""Multi-turn sampling with tools or an environment (docs/multi-turn.md): :class:`MultiTurnSampler`, the sampler a
:class:`~fsdptrain.rollout.prompt_source.PromptSource` uses when ``rollout.tools`` or ``rollout.environment`` is set:
each sample is a trajectory of several turns. Training, the greedy and the sampled evaluation all run the turns.

Every trajectory of this rank goes through the run's decoder in one turn loop; each turn's seeds are functions of
(``trainer.seed``, step, the group's global index, sample, round, turn) only (fsdptrain/generation/seeds.py): a
group's trajectories are the same whichever rank owns it, so the rollouts (and every metric) are the same on 1 and on
2 ranks. Ranks run different numbers of turns, so the decoder's block is ``uneven``: the policy's weights are always
gathered on several ranks and transformers' synced GPUs are off.

The turn loop itself is :func:`fsdptrain.rollout.turns.run_turns`; tools run through
:class:`fsdptrain.rollout.tools.ToolCaller`. A rollout's ``response_mask`` is 1 on the policy's sampled ids and 0 on
the tool segments and separators; ``truncated`` is set for any truncation cause.

Reward functions receive ``completions`` as the conversation after the prompt (a list of messages per sample:
assistant turns with their ``tool_calls``, tool messages), as TRL passes conversational completions, and
``environments=`` (one instance per sample) when an environment is configured. Reward models read the whole
conversation (the prompt's messages, then the turns) through their own chat template, as TRL passes conversational
samples (docs/reward-models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import ChatTurns
from fsdptrain.data.prompts import PromptRow
from fsdptrain.generation.decoder import Decoder, SampleMode, sampling_for
from fsdptrain.generation.seeds import eval_sample_seed, eval_turn_seed, group_seed, row_seed
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.metrics.typed import Max, Mean, Metrics, Sum
from fsdptrain.rollout.sampler import Samples
from fsdptrain.rollout.tools import (
    ENVIRONMENT_REWARD_SPEC,
    Environment,
    Tool,
    ToolCall,
    ToolCaller,
    environment_reward,
    load_environment,
    load_tools,
    start_episode,
    tool_pool,
)
from fsdptrain.rollout.turns import TRUNCATION_CAUSES, Trajectory, TurnCaps, run_turns


def load_user_tools(cfg: DictConfig) -> tuple[list[Tool], Optional[Environment]]:
    """``rollout.tools`` and ``rollout.environment``, loaded and checked (ConfigError, one line)."""
    specs = OmegaConf.to_container(cfg.rollout.tools) if cfg.rollout.tools else []
    tools = load_tools(specs)
    environment = load_environment(cfg.rollout.environment) if cfg.rollout.environment is not None else None
    if environment is not None:
        clash = sorted(set(environment.tool_names()) & {t.name for t in tools})
        if clash:
            raise ConfigError(f"rollout.environment: method {clash[0]!r} has the name of a tool in rollout.tools")
    return tools, environment


def check_multi_turn(cfg: DictConfig) -> None:
    """What the CLI checks before any rank starts: the tools and environment load, and the tokenizer's chat template
    renders tools and is prefix-preserving."""
    from fsdptrain.model.loading import build_tokenizer

    tools, environment = load_user_tools(cfg)
    ChatTurns(build_tokenizer(cfg), tool_schemas(tools, environment))


def tool_schemas(tools: list[Tool], environment: Optional[Environment]) -> list[dict]:
    return [t.schema for t in tools] + (list(environment.tool_schemas) if environment is not None else [])


def turn_metrics(trajectories: list[Trajectory]) -> Metrics:
    """This rank's multi-turn metrics; each is a SUM, MEAN or MAX of per-sample counts, so ranks and micro-batches
    reduce exactly (docs/multi-turn.md):

    - ``tools/call_frequency`` (MEAN over samples): tool calls run per sample (TRL's name);
      ``tools/calls_per_sample/mean`` is the same number and ``/max`` (MAX) the most in one sample;
    - ``tools/failure_frequency`` (MEAN over calls): the share of calls that failed (unknown tool, bad arguments,
      raised, timed out); absent when no call ran;
    - ``tools/num_malformed`` (SUM): turns whose tool call did not parse (the trajectory ended there);
      ``tools/num_timed_out`` (SUM): calls cut off at ``reward.timeout_s``; ``tools/num_cut_results`` (SUM): results
      cut to ``rollout.max_tool_response_tokens``;
    - ``tools/response_tokens/mean`` (MEAN over samples): response tokens written by tools and the template (mask 0);
    - ``turns/mean`` (MEAN over samples), ``turns/max`` (MAX): assistant turns;
    - ``truncated/<cause>`` (MEAN over samples): the share of samples truncated by ``length``, ``max_turns`` or
      ``tool_overflow``.
    """
    num = len(trajectories)
    calls = [t.num_calls for t in trajectories]
    out = {
        "tools/call_frequency": Mean(sum(calls), num),
        "tools/calls_per_sample/mean": Mean(sum(calls), num),
        "tools/calls_per_sample/max": Max(max(calls)) if calls else Max(),
        "tools/failure_frequency": Mean(sum(t.num_failed_calls for t in trajectories), sum(calls)),
        "tools/num_malformed": Sum(sum(t.num_malformed for t in trajectories)),
        "tools/num_timed_out": Sum(sum(t.num_timed_out_calls for t in trajectories)),
        "tools/num_cut_results": Sum(sum(t.num_cut_results for t in trajectories)),
        "tools/response_tokens/mean": Mean(sum(t.num_tool_tokens for t in trajectories), num),
        "turns/mean": Mean(sum(t.num_turns for t in trajectories), num),
        "turns/max": Max(max(t.num_turns for t in trajectories)) if trajectories else Max(),
    }
    for cause in TRUNCATION_CAUSES:
        out[f"truncated/{cause}"] = Mean(sum(t.truncation == cause for t in trajectories), num)
    return Metrics(out)


@dataclass
class _Turns:
    """One sampling call's trajectories with, per sample, its environment instance (None without one), its prompt's
    text as the policy saw it and its prompt's messages."""

    trajectories: list[Trajectory]
    environments: list
    prompt_texts: list[str]
    prompt_messages: list[list[dict]]


class MultiTurnSampler:
    """Samples that call tools over several turns; see the module docstring."""

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools, self.environment = load_user_tools(cfg)
        self.chat = ChatTurns(tokenizer, tool_schemas(self.tools, self.environment))
        self.caps = TurnCaps(max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                             max_tool_response_tokens=cfg.rollout.max_tool_response_tokens)
        self.caller: Optional[ToolCaller] = None

    def reward_functions(self, functions: list[RewardFunction]) -> list[RewardFunction]:
        """``functions`` and, when the environment defines ``get_reward``, one more named after its class."""
        if self.environment is None or not self.environment.has_reward:
            return functions
        name = self.environment.name
        if any(f.name == name for f in functions):
            raise ConfigError(f"rollout.environment: its get_reward is the reward {name!r}, which "
                              f"reward.functions already names")
        return [*functions, RewardFunction(name=name, spec=ENVIRONMENT_REWARD_SPEC, fn=environment_reward, weight=1.0,
                                           method="get_reward")]

    def _caller(self) -> ToolCaller:
        if self.caller is None:  # started on first use, inside the loop's try/finally that closes it
            r = self.cfg.reward
            self.caller = ToolCaller(self.tools, pool=tool_pool(self.tools, r.num_workers), timeout_s=r.timeout_s)
        return self.caller

    def close(self) -> None:
        if self.caller is not None and self.caller.pool is not None:
            self.caller.pool.close()
        self.caller = None

    def describe(self) -> str:
        names = [t.name for t in self.tools] + (self.environment.tool_names() if self.environment else [])
        env = f"; environment {self.environment.name}" if self.environment is not None else ""
        return (f"; tools: {', '.join(names) or 'none'}{env}; up to {self.cfg.rollout.max_turns} turns in "
                f"{self.cfg.rollout.max_new_tokens} response tokens")

    def sample(self, decoder: Decoder, groups: list[tuple[int, PromptRow]], *, repeat: int, mode: SampleMode,
               step: int, round_index: int, rank: int) -> Samples:
        turns = self._trajectories(decoder, groups, repeat=repeat, mode=mode, step=step, round_index=round_index)
        trajectories = turns.trajectories
        texts = [self.tokenizer.decode(t.response_ids, skip_special_tokens=False) for t in trajectories]
        return Samples(
            prompt_ids=[t.prompt_ids for t in trajectories], response_ids=[t.response_ids for t in trajectories],
            truncated=[t.truncation is not None for t in trajectories], prompts=turns.prompt_texts,
            completions=[t.messages for t in trajectories], response_texts=texts,
            answers=[_last_assistant_text(t) for t in trajectories],
            response_masks=[list(t.response_mask) for t in trajectories],
            generation_logprobs=[list(t.logprobs) for t in trajectories] if mode == "train" else None,
            routes=([torch.cat(t.routes, dim=1) if t.routes else None for t in trajectories]
                    if any(t.routes for t in trajectories) else None),
            conversations=[m + [x for x in t.messages if x.get("appended", True)]
                           for m, t in zip(turns.prompt_messages, trajectories)],
            columns={"environments": turns.environments} if self.environment is not None else {},
            details=[{"turns": t.messages, "truncated": t.truncation} for t in trajectories],
            metrics=turn_metrics(trajectories))

    def _prompts(self, row: PromptRow, repeat: int) -> tuple[list, list[tuple[list[dict], str, list[int]]]]:
        """The row's ``repeat`` environment instances (none without an environment) and each sample's prompt
        messages (the environment's first observation appended), text and ids."""
        envs, out = [], []
        for _ in range(repeat):
            messages = row.chat()
            observation = None
            if self.environment is not None:
                env, observation = start_episode(self.environment, row.columns, row=row.index,
                                                 timeout_s=self.cfg.reward.timeout_s)
                envs.append(env)
            if observation is not None:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
            text, ids = self.chat.prompt(messages)
            out.append((messages, text, ids))
        return envs, out

    def _trajectories(self, decoder: Decoder, groups: list[tuple[int, PromptRow]], *, repeat: int,
                      mode: SampleMode, step: int, round_index: int) -> _Turns:
        """Every sample's trajectory, all groups and turns through the decoder's one ``decode``; each turn seeded as
        fsdptrain/generation/seeds.py tabulates (training: its ``row_seed``, and its group's ``group_seed`` for an
        engine that decodes a group's turn from one generator; the sampled evaluation: its ``eval_turn_seed``;
        greedy: none)."""
        caller = self._caller()
        out = _Turns([], [], [], [])
        owners: list[tuple[int, int]] = []  # (group, sample) of each trajectory
        prompt_ids = []
        for group, row in groups:
            envs, prompts = self._prompts(row, repeat)
            out.prompt_messages += [messages for messages, _, _ in prompts]
            out.prompt_texts += [text for _, text, _ in prompts]
            prompt_ids += [ids for _, _, ids in prompts]
            out.environments += envs or [None] * repeat
            owners += [(group, s) for s in range(repeat)]
        seed = self.cfg.trainer.seed

        def placement(sample: int, turn: int) -> tuple[Optional[int], int, Optional[int]]:
            group, s = owners[sample]
            if mode == "train":
                return (row_seed(seed, step, group, s, round_index, turn), group,
                        group_seed(seed, step, group, round_index, turn))
            if mode == "eval":
                return eval_turn_seed(eval_sample_seed(seed, step, group, s), turn), group, None
            return None, group, None

        def call_tools(requests):
            envs = out.environments if self.environment is not None else []
            return caller.run([ToolCall(s, name, args) for s, name, args in requests], envs)

        with decoder.generating(uneven=True):
            out.trajectories = run_turns(decoder, sampling_for(self.cfg, mode, repeat=repeat), self.chat, prompt_ids,
                                         placement=placement, call_tools=call_tools, caps=self.caps)
        return out


def _last_assistant_text(trajectory: Trajectory) -> str:
    """The content of a trajectory's last assistant turn: its final answer."""
    return next((m["content"] for m in reversed(trajectory.messages) if m["role"] == "assistant"), "")
