"""What the train loop asks of a source of rollouts (:class:`RolloutSource`), which source the config names
(:func:`build_source`); docs/architecture.md, "Rollout sources".

The sources: :class:`~fsdptrain.rollout.prompt_source.PromptSource` (prompt rows sampled by the policy, scored by
reward functions and models) with a single-turn sampler (:class:`~fsdptrain.rollout.single_turn.SingleTurnSampler`)
or a multi-turn one (:class:`~fsdptrain.rollout.multi_turn.MultiTurnSampler`: each sample a trajectory of several
turns with tools or an environment), and :class:`~fsdptrain.rollout.offline_source.OfflineSource` (rollouts read from a
JSONL file). The train loop imports this module only. Group ``i`` of a step is owned by rank ``i % world_size``
(docs/architecture.md, rank ownership).
"""

from __future__ import annotations

from typing import Optional, Protocol

from omegaconf import DictConfig

from fsdptrain.config import multi_turn
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.metrics.typed import Metrics
from fsdptrain.distributed import world
from fsdptrain.distributed.placement import bridge
from fsdptrain.rollout.generator_link import GeneratorLink
from fsdptrain.rollout.agents import AgentSampler
from fsdptrain.rollout.multi_turn import MultiTurnSampler
from fsdptrain.rollout.offline_source import OfflineSource
from fsdptrain.rollout.prompt_source import PromptSource
from fsdptrain.rollout.single_turn import SingleTurnSampler
from fsdptrain.rollout.rollout_models import RolloutModels


class RolloutSource(Protocol):
    """What the train step asks of a source of experience (docs/architecture.md, "Rollout sources").

    A source owns its position in the data and whatever it keeps across steps (the prompt order, the reward models'
    running moments): :meth:`state_dict` / :meth:`load_state_dict` save and restore it with the checkpoint. The
    rollouts it returns are this rank's groups of the step (group ``i`` on rank ``i % world_size``); the step packs
    each one's prompt and response ids and trains on the response tokens its ``response_mask`` marks (all of them
    when it is None). A multi-turn prompt source's rollouts' responses also hold tokens the policy did not sample
    (tool results, separators), marked 0.
    """

    generates: bool
    """This rank's policy samples the rollouts (generation's FLOPs count in ``perf/*``)."""
    link: Optional[GeneratorLink]
    """With ``rollout.placement=separate``: this trainer rank's generator (docs/async.md); else None."""
    num_train_rows: Optional[int]
    """Training rows behind ``trainer.epochs`` (None: the source has no epochs)."""
    max_response_length: int
    step_metrics: Optional[Metrics]
    """The reward metrics of the last :meth:`rollouts` (they hold ``reward/mean``); None: plain rewards."""
    samples: list[dict]
    """A few of rank 0's samples of the last :meth:`rollouts`, for samples.jsonl."""

    def rollouts(self, models: RolloutModels, step: int, *, rank: int, world_size: int, device,
                 round_index: int = 0) -> list[Rollout]: ...

    def step_facts(self) -> Metrics:
        """Typed metrics of the source's position (``data/*``), the same on every rank."""

    def describe(self, num_steps: int) -> Optional[str]:
        """One line for the start report, or None."""

    def can_evaluate(self) -> bool: ...

    def eval_reward(self, models: RolloutModels, *, rank: int, world_size: int, device) -> float: ...

    def eval_samples(self, models: RolloutModels, *, step: int, rank: int, world_size: int, device) -> Metrics:
        """This rank's share of the sampled evaluation (``trainer.eval_n`` > 1; docs/evaluation.md), to be reduced."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


def build_source(cfg: DictConfig, tokenizer) -> RolloutSource:
    """The source ``data.source`` names: offline JSONL rollouts, else prompts with a sampler, multi-turn when
    ``rollout.tools`` or ``rollout.environment`` is set, else single-turn; with ``rollout.placement=separate`` the
    training samples come from this rank's generator (the sampler still serves the evaluation)."""
    if cfg.data.source == "jsonl":
        return OfflineSource(cfg, tokenizer)
    if cfg.rollout.agent is not None:
        sampler = AgentSampler(cfg, tokenizer)
    else:
        sampler = MultiTurnSampler(cfg, tokenizer) if multi_turn(cfg) else SingleTurnSampler(cfg, tokenizer)
    link = None
    if cfg.rollout.placement == "separate":
        link = GeneratorLink(bridge(), rank=world.rank(), max_staleness=cfg.rollout.max_staleness,
                             repeat=cfg.rollout.n)
    return PromptSource(cfg, tokenizer, sampler, link)
