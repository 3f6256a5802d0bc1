"""Offline rollouts: each step's rollouts read from a JSONL file (``data=jsonl``, fsdptrain/data/offline_rollouts.py
reads and checks the file), cycling over its groups."""

from __future__ import annotations

from omegaconf import DictConfig

from fsdptrain.data.offline_rollouts import load_jsonl_rollouts
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.metrics.typed import Max, Metrics
from fsdptrain.rollout.rollout_models import RolloutModels
from fsdptrain.run.console import log


class OfflineSource:
    """Offline JSONL rollouts: each step takes the next ``prompts_per_step`` groups, cycling over the file (the step
    alone fixes which, so the source keeps no state)."""

    generates = False
    link = None
    num_train_rows = None

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg = cfg
        rollouts, self.num_skipped = load_jsonl_rollouts(cfg.data.path, tokenizer,
                                                         max_response_length=cfg.rollout.max_new_tokens,
                                                         skip_bad_rows=cfg.data.skip_bad_rows)
        if self.num_skipped:
            log(f"warning: data.skip_bad_rows=true skipped {self.num_skipped} bad row(s) of {cfg.data.path} "
                f"(logged as data/skipped_rows)")
        self.groups: dict[int, list[Rollout]] = {}
        for r in rollouts:
            self.groups.setdefault(r.group, []).append(r)
        self.max_response_length = cfg.rollout.max_new_tokens
        self.step_metrics = None  # the rewards come with the file: no reward-function metrics
        self.samples: list[dict] = []

    def close(self) -> None:
        pass

    def step_facts(self) -> Metrics:
        """``data/skipped_rows``: bad rows of the file skipped at start (data.skip_bad_rows), the same on every
        rank."""
        return Metrics({"data/skipped_rows": Max(self.num_skipped)})

    def describe(self, num_steps: int) -> None:
        return None

    def can_evaluate(self) -> bool:
        return False

    def eval_reward(self, models: RolloutModels, *, rank: int, world_size: int, device) -> float:
        raise AssertionError("offline rollouts have no evaluation rows")

    def eval_samples(self, models: RolloutModels, *, step: int, rank: int, world_size: int, device) -> Metrics:
        raise AssertionError("offline rollouts have no evaluation rows")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rollouts(self, models: RolloutModels, step: int, *, rank: int, world_size: int, device,
                 round_index: int = 0) -> list[Rollout]:
        per_step = self.cfg.rollout.prompts_per_step
        out = []
        for index in range(per_step):
            if index % world_size != rank:
                continue
            source_group = (step * per_step + index) % len(self.groups)
            for r in self.groups[source_group]:
                out.append(Rollout(prompt_ids=r.prompt_ids, response_ids=r.response_ids, reward=r.reward,
                                   group=index, truncated=r.truncated, behaviour_logprobs=r.behaviour_logprobs,
                                   response_mask=r.response_mask, prompt_text=r.prompt_text, response_text=r.response_text))
        return out
