"""What a sampler hands the prompt source: one call's samples (:class:`Samples`), and the sampler's interface
(:class:`Sampler`). A prompt source (fsdptrain/rollout/prompt_source.py) owns the rows, their order and the scoring;
its sampler owns how a row becomes samples: one completion each (fsdptrain/rollout/single_turn.py) or a trajectory of
turns with tools or an environment (fsdptrain/rollout/multi_turn.py). Training, the greedy evaluation and the sampled
evaluation all go through the same sampler, so a multi-turn run is evaluated on trajectories that call its tools.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Protocol

from fsdptrain.data.prompts import PromptRow
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.metrics.typed import Metrics, from_plain, to_plain
from fsdptrain.generation.decoder import Decoder, SampleMode



@dataclass
class Samples:
    """One sampling call's samples, group by group (``repeat`` per row, in the rows' order); every list has one entry
    per sample."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    truncated: list[bool]
    prompts: list[str]
    """The prompt as reward functions get it (``prompts=``) and as ``Rollout.prompt_text``."""
    completions: list
    """What reward functions get as ``completions=``: the decoded text, or the conversation after the prompt."""
    response_texts: list[str]
    """``Rollout.response_text`` and samples.jsonl's ``completion``."""
    answers: list[str]
    """The text a majority vote (``eval/maj@n``) reads: the completion, or a trajectory's last assistant turn."""
    response_masks: Optional[list[list[int]]] = None
    generation_logprobs: Optional[list[list[float]]] = None
    """Per sample, each sampled token's log-prob as the generating forward computed it (``Rollout.generation_logprobs``);
    None: the engine did not record them."""
    """1 on the ids the policy sampled, 0 on those a tool or the template wrote; None: all sampled."""
    routes: Optional[list] = None
    """A mixture-of-experts policy's training samples: per sample the routes recorded at generation
    (``Rollout.routes``: ``[L, n, k]`` small ints, or None); None: nothing recorded."""
    conversations: Optional[list[list[dict]]] = None
    """The whole conversation per sample (the prompt's messages, then the turns), for reward models with a chat
    template; None: single-turn (reward models read the prompt and the completion)."""
    columns: dict[str, list] = field(default_factory=dict)
    """More per-sample reward-function arguments (``environments=``)."""
    details: list[dict] = field(default_factory=list)
    """Per sample, more fields for samples.jsonl (the turns, the truncation cause); empty: none."""
    metrics: Metrics = field(default_factory=Metrics)
    """The sampler's own metrics of this rank's samples (``tools/*``, ``turns/*``, ``truncated/*``)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def to_plain(self) -> dict:
        """Plain data (a checkpoint's, docs/async.md): every field as it is, the metrics by their slots. Samples
        with per-sample objects in ``columns`` (an environment's) have none (ValueError)."""
        if self.columns:
            raise ValueError(f"samples with reward-function columns {sorted(self.columns)} have no plain form")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "metrics"}
        return {**fields, "metrics": to_plain(self.metrics)}

    @staticmethod
    def from_plain(plain: dict) -> "Samples":
        return Samples(**{**plain, "metrics": from_plain(plain["metrics"])})


class Sampler(Protocol):
    """How a prompt source's rows become samples; see the module docstring."""

    def sample(self, decoder: Decoder, groups: list[tuple[int, PromptRow]], *, repeat: int, mode: SampleMode,
               step: int, round_index: int, rank: int) -> Samples:
        """``repeat`` samples of each ``(global index, row)`` of this rank, through ``decoder`` (its block entered
        here). Collective (generation)."""

    def reward_functions(self, functions: list[RewardFunction]) -> list[RewardFunction]:
        """The run's reward functions with the sampler's own added (an environment's ``get_reward``)."""

    def describe(self) -> str:
        """What the start report adds about the sampler ('' for none)."""

    def close(self) -> None: ...
