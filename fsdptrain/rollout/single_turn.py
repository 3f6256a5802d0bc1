"""Single-turn sampling: each sample is one completion of its prompt (:class:`SingleTurnSampler`).

Training: a rank samples all its groups in one batched ``generate`` call from a generator seeded by
(``trainer.seed``, step, rank) (``sampling_seed``; an extra round of dynamic sampling adds its own offset), the
group's ``rollout.n`` copies of a prompt prefilled once. The greedy evaluation decodes greedily; the sampled one draws
each sample from its own generator (``eval_sample_seed``), so it is the same at any world size.
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from fsdptrain.data.prompts import PromptRow, prompt_token_ids
from fsdptrain.generation.generate import generate_responses
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.rollout.continuous import generate_continuous, make_engine, row_seed
from fsdptrain.rollout.sampler import SampleMode, Samples
from fsdptrain.generation.block import eval_sample_seed, generation, sampling_seed
from fsdptrain.train.setup import Models


class SingleTurnSampler:
    """One completion per sample; see the module docstring."""

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer

    def reward_functions(self, functions: list[RewardFunction]) -> list[RewardFunction]:
        return functions

    def describe(self) -> str:
        return ""

    def close(self) -> None:
        pass

    def sample(self, models: Models, groups: list[tuple[int, PromptRow]], *, repeat: int, mode: SampleMode,
               step: int, round_index: int, rank: int, device) -> Samples:
        seed = self.cfg.trainer.seed
        rows = [row for _, row in groups]
        row_seeds = None
        if mode == "eval":
            row_seeds = [eval_sample_seed(seed, step, i, s) for i, _ in groups for s in range(repeat)]
        generator_seed = (sampling_seed(seed, step, rank) + 104_729 * round_index) % (2**31) if mode == "train" else 0
        if self.cfg.rollout.engine == "continuous":
            if mode == "train":
                row_seeds = [row_seed(seed, step, i, s, round_index, 0) for i, _ in groups for s in range(repeat)]
            outputs = self._continuous(models, rows, repeat=repeat, mode=mode, device=device, row_seeds=row_seeds)
        else:
            outputs = self._generate(models, rows, repeat=repeat, sample=mode == "train", seed=generator_seed,
                                     device=device, row_seeds=row_seeds)
        completions = [self.tokenizer.decode(ids, skip_special_tokens=True) for _, ids, _, *_ in outputs]
        generated = [list(out[3]) for out in outputs] if mode == "train" else None
        return Samples(prompt_ids=[out[0] for out in outputs], response_ids=[out[1] for out in outputs],
                       truncated=[out[2] for out in outputs],
                       prompts=[row.text for row in rows for _ in range(repeat)], completions=completions,
                       response_texts=completions, answers=completions, generation_logprobs=generated)

    def _generate(self, models: Models, rows: list[PromptRow], *, repeat: int, sample: bool, seed: int, device,
                  row_seeds: Optional[list[int]] = None):
        """``repeat`` responses per row: sampled at the rollout settings, greedy, or (``row_seeds``) sampled at
        ``trainer.eval_temperature`` with one generator per response."""
        ids = [prompt_token_ids(self.tokenizer, row) for row in rows for _ in range(repeat)]
        rollout = self.cfg.rollout
        temperature = (rollout.temperature if sample else
                       self.cfg.trainer.eval_temperature if row_seeds is not None else 1.0)
        with generation(models.policy, self.cfg, device):  # timed, sdpa, weights gathered once, layers eager
            return generate_responses(
                models.policy, self.tokenizer, ids, max_new_tokens=rollout.max_new_tokens,
                temperature=temperature, top_p=rollout.top_p if sample else 1.0,
                do_sample=sample, generator_seed=seed, device=device, row_seeds=row_seeds,
                share_prompt_prefill=repeat > 1 and row_seeds is None, record_logprobs=sample)

    def _continuous(self, models: Models, rows: list[PromptRow], *, repeat: int, mode: SampleMode, device,
                    row_seeds: Optional[list[int]]):
        """The same samples through the continuous engine (fsdptrain/rollout/continuous.py): each from its own
        seed (greedy: none), the weights gathered for the block."""
        ids = [prompt_token_ids(self.tokenizer, row) for row in rows for _ in range(repeat)]
        rollout = self.cfg.rollout
        sample = mode == "train"
        temperature = rollout.temperature if sample else self.cfg.trainer.eval_temperature if mode == "eval" else 1.0
        with generation(models.policy, self.cfg, device, always_gather=True):
            engine = make_engine(models.policy, self.cfg, self.tokenizer, temperature=temperature,
                                 top_p=rollout.top_p if sample else 1.0)
            return generate_continuous(engine, ids, row_seeds or [None] * len(ids),
                                       max_new_tokens=rollout.max_new_tokens)
