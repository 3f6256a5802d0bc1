"""Single-turn sampling: each sample is one completion of its prompt (:class:`SingleTurnSampler`).

Every sample is one :class:`~fsdptrain.generation.decoder.Request` to the run's decoder, seeded as
fsdptrain/generation/seeds.py tabulates: in training its own ``row_seed`` (the continuous engine) and the rank's batch
seed (``generate``, which draws the rank's whole batch from one generator); in the sampled evaluation its own
``eval_sample_seed``, so it is the same at any world size; greedy decoding takes none.
"""

from __future__ import annotations

from omegaconf import DictConfig

from fsdptrain.data.prompts import PromptRow, prompt_token_ids
from fsdptrain.generation.decoder import Decoder, Request, SampleMode, sampling_for
from fsdptrain.generation.seeds import batch_seed, eval_sample_seed, row_seed
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.rollout.sampler import Samples


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

    def sample(self, decoder: Decoder, groups: list[tuple[int, PromptRow]], *, repeat: int, mode: SampleMode,
               step: int, round_index: int, rank: int) -> Samples:
        seed = self.cfg.trainer.seed
        rows = [row for _, row in groups]
        requests = []
        for group, row in groups:
            ids = prompt_token_ids(self.tokenizer, row)
            for s in range(repeat):
                requests.append(Request(
                    len(requests), list(ids), self.cfg.rollout.max_new_tokens,
                    seed=(row_seed(seed, step, group, s, round_index, 0) if mode == "train" else
                          eval_sample_seed(seed, step, group, s) if mode == "eval" else None),
                    batch_seed=batch_seed(seed, step, rank, round_index) if mode == "train" else None))
        with decoder.generating():  # timed, sdpa, weights gathered as rollout.gather_weights says, layers eager
            generated = {g.key: g for g in decoder.decode(requests, sampling_for(self.cfg, mode, repeat=repeat))}
        outputs = [generated[r.key] for r in requests]
        completions = [self.tokenizer.decode(g.new_ids, skip_special_tokens=True) for g in outputs]
        return Samples(prompt_ids=[r.new_ids for r in requests], response_ids=[g.new_ids for g in outputs],
                       truncated=[g.truncated for g in outputs],
                       prompts=[row.text for row in rows for _ in range(repeat)], completions=completions,
                       response_texts=completions, answers=completions,
                       generation_logprobs=[list(g.logprobs) for g in outputs] if mode == "train" else None,
                       routes=[g.routes for g in outputs] if any(g.routes is not None for g in outputs) else None)
