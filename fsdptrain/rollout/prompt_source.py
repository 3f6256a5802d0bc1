"""Prompt rows sampled by the policy: :class:`PromptSource`, one prompt source with a sampler, single-turn
(fsdptrain/rollout/single_turn.py) or multi-turn (fsdptrain/rollout/multi_turn.py); multi-turn is composition, not a
subclass.

Rows of a prompt dataset, sampled ``n`` times each by the policy, scored by reward functions (and reward models) the
same way whichever the sampler (docs/reward-models.md), evaluated by fsdptrain/rollout/evaluation.py. One
path for the bundled digit tasks and for a user's files (docs/your-task.md): ``data=task`` feeds the rows of
:func:`fsdptrain.data.prompt_tasks.digit_task_rows` with the ``word_match`` reward, ``data=prompts`` the rows of
``data.path`` with ``reward.functions``; from there on the code is the same. Each step takes the next
``rollout.prompts_per_step`` positions of the seeded epoch order (the same on every rank); group ``i`` of the step is
training row ``positions[i]``, owned by rank ``i % world_size`` (docs/architecture.md, rank ownership). The order's
state goes into checkpoints, so a resumed run sees exactly the prompts an uninterrupted one would, at any world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import ConfigError, reward_specs
from fsdptrain.data.epoch_order import EpochOrder
from fsdptrain.data.prompt_tasks import digit_task_rows
from fsdptrain.data.prompts import PromptRow, drop_long_prompts, hold_out_eval, load_prompts
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.generation.decoder import SampleMode
from fsdptrain.generation.engines import make_decoder
from fsdptrain.metrics.typed import Max, Metrics, merge_all
from fsdptrain.model.loading import max_positions
from fsdptrain.rewards.loading import load_reward_functions
from fsdptrain.rewards.reward_metrics import reward_metrics
from fsdptrain.rewards.runner import RewardBatch, RewardError, RewardFailedOnAnotherRank, RewardRunner, RewardScores
from fsdptrain.rl.reward_scale import RunningMoments
from fsdptrain.rollout.evaluation import greedy_reward, sampled_eval
from fsdptrain.rollout.generator_link import GeneratorLink
from fsdptrain.rollout.rollout_models import RolloutModels
from fsdptrain.rollout.sampler import Sampler, Samples
from fsdptrain.rollout.scoring import ModelScores, score_with_reward_models
from fsdptrain.rollout.single_turn import SingleTurnSampler
from fsdptrain.run.perf import phase
from fsdptrain.run.signals import user_code

NUM_SAMPLES_SHOWN = 4
"""Samples of rank 0 kept for samples.jsonl and the first step's printout."""


def stale_behaviour(rollouts: list[Rollout], *, max_staleness: int) -> list[Rollout]:
    """Rollouts a generator rank sampled (``rollout.placement=separate``) with the behaviour log-probs the experience
    must use: at ``max_staleness`` k > 0 the weights that sampled them are up to k versions older than the trainer's,
    so each carries its generating forward's log-probs (``generation_logprobs``) as ``behaviour_logprobs`` and the
    step is off-policy (the old pass runs; without a rollout correction the old log-probs are these); at k = 0 the
    generator held the trainer's own weights, so they carry none (on-policy, as colocated). check-metrics runs this
    same function on its emulated stale batch (fsdptrain/check/staleness.py)."""
    if max_staleness == 0:
        return rollouts
    return [dataclasses.replace(r, behaviour_logprobs=r.generation_logprobs) for r in rollouts]


def _task_rows(rows: list[dict]) -> list[PromptRow]:
    return [PromptRow(index=i, text=r["prompt"], columns={"answer": r["answer"]}) for i, r in enumerate(rows)]


def load_rows(cfg: DictConfig, tokenizer) -> tuple[list[PromptRow], list[PromptRow], dict[str, int]]:
    """``(train, eval, dropped)``: the training and evaluation rows and how many long prompts each lost."""
    data = cfg.data
    if data.source == "task":
        train = _task_rows(digit_task_rows(data.task, num_rows=data.num_rows, seed=data.seed))
        evals = _task_rows(digit_task_rows(data.task, num_rows=data.num_eval_prompts, seed=-1 - data.seed))
        return train, evals, {"train": 0, "eval": 0}
    key = data.prompt_key
    plain = lambda value: OmegaConf.to_container(value) if OmegaConf.is_config(value) else value  # noqa: E731
    rows = load_prompts(plain(data.path), tokenizer=tokenizer, prompt_key=key, what="data.path")
    if data.eval_path is not None:
        train, evals = rows, load_prompts(plain(data.eval_path), tokenizer=tokenizer, prompt_key=key,
                                          what="data.eval_path")
    else:
        train, evals = hold_out_eval(rows, eval_size=data.num_eval_prompts, seed=data.seed)
    length = dict(tokenizer=tokenizer, max_prompt_length=data.max_prompt_length, long_prompts=data.long_prompts,
                  max_positions=max_positions(cfg), max_new_tokens=cfg.rollout.max_new_tokens)
    train, dropped_train = drop_long_prompts(train, label="data.path", **length)
    dropped_eval = 0
    if evals:
        evals, dropped_eval = drop_long_prompts(evals, label="data.eval_path or the held-out rows", **length)
    if 0 < len(evals) < world.world_size():
        raise ConfigError(f"{len(evals)} evaluation prompts for {world.world_size()} ranks: every rank needs one "
                          f"(add rows to data.eval_path, or set trainer.eval_every=0)")
    return train, evals, {"train": dropped_train, "eval": dropped_eval}


def _per_sample(mine: list[tuple[int, PromptRow]], repeat: int) -> tuple[list[PromptRow], list[int]]:
    """Each sample's row and group (its global index), ``repeat`` samples per ``(global index, row)``, in order."""
    return [row for _, row in mine for _ in range(repeat)], [i for i, _ in mine for _ in range(repeat)]


class PromptSource:
    """Prompt rows in epoch order, ``n`` samples each from its sampler (single-turn by default, multi-turn with tools
    or an environment), scored by the reward functions and models; see the module docstring."""

    generates = True

    def __init__(self, cfg: DictConfig, tokenizer, sampler: Optional[Sampler] = None,
                 link: Optional[GeneratorLink] = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.link = link
        """With ``rollout.placement=separate``: this trainer rank's generator, which samples its training groups
        (fsdptrain/rollout/generator_link.py); the evaluation still samples here."""
        self.generates = link is None  # else the generators' FLOPs, not this rank's
        self.train_rows, self.eval_rows, self.dropped = load_rows(cfg, tokenizer)
        self.num_train_rows = len(self.train_rows)
        self.order = EpochOrder(len(self.train_rows), seed=cfg.data.seed)
        columns = sorted({name for row in self.train_rows[:1] for name in row.columns}
                         | ({"environments"} if cfg.rollout.environment is not None else set())
                         | ({"agent_rewards"} if cfg.rollout.agent is not None else set()))
        specs = reward_specs(cfg)
        functions = load_reward_functions(specs, cfg.reward.weights, columns=columns) if specs else []
        self.sampler: Sampler = sampler if sampler is not None else SingleTurnSampler(cfg, tokenizer)
        self.functions = self.sampler.reward_functions(functions)
        self.reward_moments = [RunningMoments() for _ in cfg.reward.models]
        """Running moments of each reward model's raw scores (reward.model_normalize=running), in checkpoints."""
        self.max_response_length = cfg.rollout.max_new_tokens
        self.runner: Optional[RewardRunner] = None
        self.step_metrics: Optional[Metrics] = None
        self.samples: list[dict] = []
        self.last_batch: Optional[RewardBatch] = None
        self.last_scores: Optional[RewardScores] = None
        self.last_model_scores: Optional[ModelScores] = None

    def _runner(self) -> RewardRunner:
        if self.runner is None:  # started on first use, inside the loop's try/finally that closes it
            r = self.cfg.reward
            self.runner = RewardRunner(self.functions, num_workers=r.num_workers, timeout_s=r.timeout_s,
                                       timeout_score=r.timeout_score)
        return self.runner

    def close(self) -> None:
        if self.link is not None:
            self.link.stop()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        self.sampler.close()

    def epoch_progress(self) -> float:
        """Epochs of the training rows visited so far (fractional)."""
        return self.order.epoch + self.order.position / self.order.num_rows

    def step_facts(self) -> Metrics:
        """``data/epoch`` (epochs visited so far) and ``data/num_long_prompts_skipped`` (training rows dropped as
        too long at start): the same on every rank, so MAX over ranks is the value."""
        return Metrics({"data/epoch": Max(self.epoch_progress()),
                        "data/num_long_prompts_skipped": Max(self.dropped["train"])})

    def describe(self, num_steps: int) -> str:
        cfg, dropped = self.cfg, self.dropped
        weights = cfg.reward.model_weights or [1.0] * len(cfg.reward.models)
        models = [f"reward_model/{m} ({path}) x {w:g}" for m, (path, w) in enumerate(zip(cfg.reward.models, weights))]
        return (f"prompts: {len(self.train_rows)} training rows, {len(self.eval_rows)} evaluation rows"
                + (f"; skipped {dropped['train']} + {dropped['eval']} too long (data.max_prompt_length, or the "
                   "model's positions after rollout.max_new_tokens)"
                   if dropped["train"] or dropped["eval"] else "")
                + f"; {num_steps} steps of {cfg.rollout.prompts_per_step} prompts = "
                f"{num_steps * cfg.rollout.prompts_per_step / len(self.train_rows):.3g} epochs; rewards: "
                + ", ".join([f"{f.name} x {f.weight:g}" for f in self.functions] + models)
                + self.sampler.describe())

    def can_evaluate(self) -> bool:
        return bool(self.eval_rows)

    def state_dict(self) -> dict:
        """The prompt order's position and the reward models' running moments."""
        state = {"prompt_order": self.order.state_dict(),
                 "reward_model_moments": [m.state_dict() for m in self.reward_moments]}
        if self.link is not None:  # collective over the trainer ranks
            state["generator_link"] = self.link.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; one saved by another data.source, or for other reward models, is a
        ConfigError."""
        if "prompt_order" not in state:
            raise ConfigError("the checkpoint holds no prompt order (it was saved by a run with another data.source)")
        self.order.load_state_dict(state["prompt_order"])
        saved = state["reward_model_moments"]
        if len(saved) != len(self.reward_moments):
            raise ConfigError(f"the checkpoint holds running moments of {len(saved)} reward models, but reward.models "
                              f"lists {len(self.reward_moments)}: resume with the run's own reward.models")
        self.reward_moments = [RunningMoments.from_state_dict(m) for m in saved]
        if self.link is not None:
            self.link.load_state_dict(state.get("generator_link", {"trainer_ranks": 0, "in_flight": []}))

    def sample_and_score(self, models: RolloutModels, mine: list[tuple[int, PromptRow]], *, repeat: int,
                         mode: SampleMode, step: int, round_index: int, rank: int,
                         device) -> tuple[Samples, RewardBatch, RewardScores, Metrics]:
        """``repeat`` samples of each of this rank's ``(global index, row)`` from the sampler, through the decoder
        ``rollout.engine`` names (fsdptrain/generation/decoder.py), scored (see :meth:`score`); a ``train`` call
        keeps the reward models' running moments. Collective."""
        decoder = make_decoder(self.cfg, models.policy, self.tokenizer, device)
        samples = self.sampler.sample(decoder, mine, repeat=repeat, mode=mode, step=step, round_index=round_index,
                                      rank=rank)
        rows, groups = _per_sample(mine, repeat)
        with phase("reward") if mode == "train" else contextlib.nullcontext():  # evaluation is not the step's
            batch, scores, model_metrics = self.score(models, rows, groups, samples, device=device,
                                                      training=mode == "train")
        return samples, batch, scores, model_metrics

    def score(self, models: RolloutModels, rows: list[PromptRow], groups: list[int], samples: Samples, *, device,
              training: bool) -> tuple[RewardBatch, RewardScores, Metrics]:
        """Score this rank's samples: the reward functions' weighted total plus the reward models' weighted, scaled
        scores (docs/reward-models.md), single- and multi-turn alike. A function's failure on any rank stops every
        rank (one agreed flag, no hang). Only a ``training`` call keeps the reward models' running moments."""
        names = sorted({name for row in rows for name in row.columns})
        batch = RewardBatch(
            prompts=list(samples.prompts), completions=list(samples.completions),
            completion_ids=[list(ids) for ids in samples.response_ids],
            rows=[row.index for row in rows], groups=list(groups),
            columns={**{name: [row.columns.get(name) for row in rows] for name in names}, **samples.columns})
        scores = self._function_scores(batch)
        if not models.reward_models:
            return batch, scores, Metrics({})
        model_scores = self._score_with_models(models, samples, device=device)
        if training:
            self.reward_moments = model_scores.running
        self.last_model_scores = model_scores
        total = [t + float(m) for t, m in zip(scores.total, model_scores.total_N)]
        return batch, dataclasses.replace(scores, total=total), model_scores.metrics

    def _function_scores(self, batch: RewardBatch) -> RewardScores:
        """The reward functions' scores of ``batch`` (all 0.0 without functions). A function's failure on any rank
        stops every rank (one agreed flag, no hang)."""
        if not self.functions:
            return RewardScores(raw={}, total=[0.0] * len(batch), num_timed_out={}, num_no_reward=0)
        scores, error = None, None
        names = ", ".join(repr(f.name) for f in self.functions)
        try:
            with user_code(f"a call of the reward functions {names}"):  # a stop signal gets a grace (signals.py)
                scores = self._runner().score(batch)
        except RewardError as err:
            error = err
        if world.any_flag(error is not None):
            raise error if error is not None else RewardFailedOnAnotherRank()
        return scores

    def _score_with_models(self, models: RolloutModels, samples: Samples, *, device) -> ModelScores:
        """The reward models' scores: of the prompt and completion texts, or of a multi-turn sample's conversation
        (``samples.conversations``) through a model's chat template."""
        r = self.cfg.reward
        weights = [1.0] * len(r.models) if r.model_weights is None else [float(w) for w in r.model_weights]
        return score_with_reward_models(
            models.reward_models, models.reward_specs, samples.prompts, samples.response_texts, weights=weights,
            mode=r.model_normalize, clip=r.model_clip, running=self.reward_moments,
            token_budget=self.cfg.trainer.token_budget, device=device, conversations=samples.conversations)

    def rollouts(self, models: RolloutModels, step: int, *, rank: int, world_size: int, device,
                 round_index: int = 0) -> list[Rollout]:
        """This rank's rollouts of the step's next ``prompts_per_step`` rows; ``round_index`` > 0 is an extra round of
        dynamic sampling (the next rows of the order, its own sampling seed; the reward metrics cover every round)."""
        n = self.cfg.rollout.n

        def plan() -> list[tuple[int, PromptRow]]:
            positions = self.order.take(self.cfg.rollout.prompts_per_step)
            return [(i, self.train_rows[p]) for i, p in enumerate(positions) if i % world_size == rank]

        if self.link is None:
            samples, batch, scores, model_metrics = self.sample_and_score(
                models, plan(), repeat=n, mode="train", step=step, round_index=round_index, rank=rank, device=device)
        else:
            samples, batch, scores, model_metrics = self._from_generator(models, step, plan, device=device)
        groups = batch.groups
        metrics = merge_all([reward_metrics(scores, groups=groups), model_metrics, samples.metrics])
        self.step_metrics = metrics if round_index == 0 else merge_all([self.step_metrics, metrics])
        self.last_batch, self.last_scores = batch, scores
        self.samples = [self._sample(models, batch, scores, samples, k)
                        for k in range(min(NUM_SAMPLES_SHOWN, len(batch)))]
        masks, generated, routes = samples.response_masks, samples.generation_logprobs, samples.routes
        rollouts = [Rollout(prompt_ids=samples.prompt_ids[k], response_ids=samples.response_ids[k],
                            reward=scores.total[k], group=groups[k], truncated=samples.truncated[k],
                            prompt_text=samples.prompts[k], response_text=samples.response_texts[k],
                            response_mask=None if masks is None else masks[k],
                            generation_logprobs=None if generated is None else generated[k],
                            routes=None if routes is None else routes[k])
                    for k in range(len(samples))]
        if self.link is None:
            return rollouts
        return stale_behaviour(rollouts, max_staleness=self.cfg.rollout.max_staleness)

    def _from_generator(self, models: RolloutModels, step: int, plan, *,
                        device) -> tuple[Samples, RewardBatch, RewardScores, Metrics]:
        """This rank's samples of ``step`` from its generator (the trainer's wait is the step's ``generate``
        phase), scored here; the link's metrics join the sampler's."""
        with phase("generate"):
            mine, samples, link_metrics = self.link.samples(step, plan)
        samples = dataclasses.replace(samples, metrics=merge_all([samples.metrics, link_metrics]))
        rows, groups = _per_sample(mine, self.cfg.rollout.n)
        with phase("reward"):
            batch, scores, model_metrics = self.score(models, rows, groups, samples, device=device, training=True)
        return samples, batch, scores, model_metrics

    def _sample(self, models: RolloutModels, batch: RewardBatch, scores: RewardScores, samples: Samples,
                k: int) -> dict:
        """One sample for samples.jsonl and the first step's printout: the prompt, the completion, what the sampler
        adds (a trajectory's turns and truncation cause), the rewards."""
        return {"row": batch.rows[k], "prompt": batch.prompts[k], "completion": samples.response_texts[k],
                **(samples.details[k] if samples.details else {}),
                "rewards": {**{name: values[k] for name, values in scores.raw.items()}, **self._model_rewards(models, k)},
                "total": scores.total[k]}

    def _model_rewards(self, models: RolloutModels, k: int) -> dict[str, float]:
        """Sample ``k``'s scaled score from each reward model, for samples.jsonl."""
        if not models.reward_models:
            return {}
        return {f"reward_model/{m}": float(s[k]) for m, s in enumerate(self.last_model_scores.scaled_N)}

    def eval_reward(self, models: RolloutModels, *, rank: int, world_size: int, device) -> float:
        """Greedy mean reward over the evaluation rows (fsdptrain/rollout/evaluation.py)."""
        return greedy_reward(functools.partial(self.sample_and_score, models, device=device), self.eval_rows,
                             rank=rank, world_size=world_size)

    def eval_samples(self, models: RolloutModels, *, step: int, rank: int, world_size: int, device) -> Metrics:
        """This rank's share of the sampled evaluation (fsdptrain/rollout/evaluation.py), to be reduced."""
        return sampled_eval(functools.partial(self.sample_and_score, models, device=device), self.eval_rows,
                            self.functions, num_reward_models=len(models.reward_models), trainer=self.cfg.trainer,
                            step=step, rank=rank, world_size=world_size)
