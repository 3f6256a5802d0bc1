"""Multi-turn rollouts with tools or an environment (docs/multi-turn.md): :class:`MultiTurnSource`, a
:class:`~fsdptrain.rollout.prompt_source.PromptSource` whose samples are trajectories of several turns.

Each prompt group is generated on its own (``n`` samples in one batch per turn), with a sampling seed drawn from
(``trainer.seed``, step, the group's global index, round, turn): a group's trajectories are the same whichever rank
owns it, so the rollouts (and every metric) are the same on 1 and on 2 ranks. Ranks run different numbers of turns,
so generation always holds the policy's weights gathered (``rollout.gather_weights`` is not consulted) and runs
without transformers' synced GPUs.

The turn loop itself is :func:`fsdptrain.rollout.turns.run_turns`; tools run through
:class:`fsdptrain.rollout.tools.ToolCaller`. A rollout's ``response_mask`` is 1 on the policy's sampled ids and 0 on
the tool segments and separators; ``truncated`` is set for any truncation cause.

Reward functions receive ``completions`` as the conversation after the prompt (a list of messages per sample:
assistant turns with their ``tool_calls``, tool messages), as TRL passes conversational completions, and
``environments=`` (one instance per sample) when an environment is configured.
"""

from __future__ import annotations

import random
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import ChatTurns
from fsdptrain.data.prompts import PromptRow
from fsdptrain.data.rollout import Rollout
from fsdptrain.distributed import world
from fsdptrain.model.generate import generate_responses
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.rewards.reward_metrics import reward_metrics
from fsdptrain.rewards.runner import RewardBatch
from fsdptrain.rollout.tools import (
    ENVIRONMENT_REWARD_SPEC,
    Environment,
    Tool,
    ToolCaller,
    ToolCall,
    environment_reward,
    load_environment,
    load_tools,
    tool_pool,
)
from fsdptrain.rl.metrics import Max, Mean, Metrics, Sum, merge_all
from fsdptrain.rollout.prompt_source import PromptSource
from fsdptrain.rollout.sampling import NUM_SAMPLES_SHOWN, generation
from fsdptrain.rollout.turns import TRUNCATION_CAUSES, Trajectory, TurnCaps, run_turns
from fsdptrain.train.build import Models
from fsdptrain.train.perf import phase


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
    from fsdptrain.train.build import build_tokenizer

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


def group_seed(seed: int, step: int, group: int, round_index: int, turn: int) -> int:
    """The sampling seed of one group's turn: a function of where it is in the run, never of the rank."""
    return random.Random(f"turns:{seed}:{step}:{group}:{round_index}:{turn}").getrandbits(31)


class MultiTurnSource(PromptSource):
    """Prompt rows whose samples call tools over several turns; see the module docstring."""

    def __init__(self, cfg: DictConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.tools, self.environment = load_user_tools(cfg)
        self.chat = ChatTurns(tokenizer, tool_schemas(self.tools, self.environment))
        if self.environment is not None and self.environment.has_reward:
            name = self.environment.name
            if any(f.name == name for f in self.functions):
                raise ConfigError(f"rollout.environment: its get_reward is the reward {name!r}, which "
                                  f"reward.functions already names")
            self.functions.append(RewardFunction(name=name, spec=ENVIRONMENT_REWARD_SPEC, fn=environment_reward,
                                                 weight=1.0))
        self.caps = TurnCaps(max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                             max_tool_response_tokens=cfg.rollout.max_tool_response_tokens)
        self.caller: Optional[ToolCaller] = None

    def _caller(self) -> ToolCaller:
        if self.caller is None:  # started on first use, inside the loop's try/finally that closes it
            r = self.cfg.reward
            self.caller = ToolCaller(self.tools, pool=tool_pool(self.tools, r.num_workers), timeout_s=r.timeout_s)
        return self.caller

    def close(self) -> None:
        super().close()
        if self.caller is not None and self.caller.pool is not None:
            self.caller.pool.close()
        self.caller = None

    def describe(self, num_steps: int) -> str:
        names = [t.name for t in self.tools] + (self.environment.tool_names() if self.environment else [])
        env = f"; environment {self.environment.name}" if self.environment is not None else ""
        return (super().describe(num_steps) + f"; tools: {', '.join(names) or 'none'}{env}; up to "
                f"{self.cfg.rollout.max_turns} turns in {self.cfg.rollout.max_new_tokens} response tokens")

    def _trajectories(self, models: Models, groups: list[tuple[int, PromptRow]], *, repeat: int, sample: bool,
                      step: int, round_index: int, device) -> tuple[list[Trajectory], list, list[str]]:
        """Every sample's trajectory, group by group, its environment instance (None without one), and the text of
        its prompt as the policy saw it (the tools' schemas and the environment's first observation included)."""
        rollout, caller = self.cfg.rollout, self._caller()
        trajectories, environments, prompt_texts = [], [], []
        with generation(models.policy, self.cfg, device, always_gather=True):
            for group, row in groups:
                envs = [self.environment.cls() for _ in range(repeat)] if self.environment is not None else []
                prompts = []
                for k in range(repeat):
                    messages = row.chat()
                    observation = envs[k].reset(**row.columns) if envs else None
                    if observation is not None:
                        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
                    text, ids = self.chat.prompt(messages)
                    prompts.append(ids)
                    prompt_texts.append(text)

                def generate(inputs, max_new_tokens, turn, group=group):
                    outputs = generate_responses(
                        models.policy, self.tokenizer, inputs, max_new_tokens=max_new_tokens,
                        temperature=rollout.temperature if sample else 1.0, top_p=rollout.top_p if sample else 1.0,
                        do_sample=sample, generator_seed=group_seed(self.cfg.trainer.seed, step, group, round_index,
                                                                    turn),
                        device=device, synced_gpus=False)
                    return [(ids, not truncated) for _, ids, truncated in outputs]

                def call_tools(requests, envs=envs):  # timed within the generate phase
                    return caller.run([ToolCall(s, name, args) for s, name, args in requests], envs)

                trajectories += run_turns(self.chat, prompts, generate=generate, call_tools=call_tools,
                                          caps=self.caps)
                environments += envs or [None] * repeat
        return trajectories, environments, prompt_texts

    def _batch(self, rows: list[PromptRow], groups: list[int], trajectories: list[Trajectory],
               environments: list, prompt_texts: list[str]) -> RewardBatch:
        names = sorted({name for row in rows for name in row.columns})
        columns = {name: [row.columns.get(name) for row in rows] for name in names}
        if self.environment is not None:
            columns["environments"] = environments
        return RewardBatch(prompts=prompt_texts, completions=[t.messages for t in trajectories],
                           completion_ids=[list(t.response_ids) for t in trajectories],
                           rows=[row.index for row in rows], groups=list(groups), columns=columns)

    def rollouts(self, models: Models, step: int, *, rank: int, world_size: int, device,
                 round_index: int = 0) -> list[Rollout]:
        """This rank's trajectories of the step's next ``prompts_per_step`` rows, scored; see the module docstring."""
        n = self.cfg.rollout.n
        positions = self.order.take(self.cfg.rollout.prompts_per_step)
        mine = [(i, self.train_rows[p]) for i, p in enumerate(positions) if i % world_size == rank]
        trajectories, environments, prompt_texts = self._trajectories(
            models, mine, repeat=n, sample=True, step=step, round_index=round_index, device=device)
        rows = [row for _, row in mine for _ in range(n)]
        groups = [i for i, _ in mine for _ in range(n)]
        batch = self._batch(rows, groups, trajectories, environments, prompt_texts)
        with phase("reward"):
            scores = self._function_scores(batch)
        metrics = merge_all([reward_metrics(scores, groups=groups), turn_metrics(trajectories)])
        self.step_metrics = metrics if round_index == 0 else merge_all([self.step_metrics, metrics])
        self.last_batch, self.last_scores = batch, scores
        self.samples = [self._sample(batch, scores, trajectories[k], k)
                        for k in range(min(NUM_SAMPLES_SHOWN, len(batch)))]
        return [Rollout(prompt_ids=t.prompt_ids, response_ids=t.response_ids, reward=scores.total[k],
                        group=groups[k], truncated=t.truncation is not None, prompt_text=prompt_texts[k],
                        response_text=self.tokenizer.decode(t.response_ids, skip_special_tokens=False),
                        response_mask=list(t.response_mask))
                for k, t in enumerate(trajectories)]

    def _sample(self, batch: RewardBatch, scores, trajectory: Trajectory, k: int) -> dict:
        """One sample for samples.jsonl and the first step's printout: the turns with their tool calls and results,
        the truncation cause, the rewards."""
        return {"row": batch.rows[k], "prompt": batch.prompts[k],
                "completion": self.tokenizer.decode(trajectory.response_ids, skip_special_tokens=False),
                "turns": trajectory.messages, "truncated": trajectory.truncation,
                "rewards": {name: values[k] for name, values in scores.raw.items()}, "total": scores.total[k]}

    @torch.no_grad()
    def eval_reward(self, models: Models, *, rank: int, world_size: int, device) -> float:
        """Greedy mean reward over the evaluation rows' trajectories, over all ranks."""
        mine = [(i, row) for i, row in enumerate(self.eval_rows) if i % world_size == rank]
        trajectories, environments, prompt_texts = self._trajectories(models, mine, repeat=1, sample=False, step=-1,
                                                                      round_index=0, device=device)
        batch = self._batch([row for _, row in mine], [i for i, _ in mine], trajectories, environments,
                            prompt_texts)
        scores = self._function_scores(batch)
        sums = world.all_reduce_sum(torch.tensor([sum(scores.total), float(len(mine))], dtype=torch.float64))
        return float(sums[0] / sums[1])
