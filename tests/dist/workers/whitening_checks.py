"""Global whitening on 2 ranks: every estimator that whitens, each rank holding half of a ragged batch.

Writes this rank's advantages per sequence (by global index) and the one-process result computed on rank 0 over the
whole batch with no process group in the loop (`sum_across_ranks` is the identity there).
"""

from __future__ import annotations

import torch

from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.rl.estimator_registry import AdvSettings, resolve_adv_estimator
from fsdptrain.train.experience import estimate_advantages
from tests.dist.workers.report import dist_worker

ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
NUM_SEQS = 9  # groups of 3 (i // 3); group g is owned by rank g % 2, as in the trainer: 6 and 3 sequences


def batch():
    gen = torch.Generator().manual_seed(3)
    rollouts, rewards, values = [], [], []
    for i in range(NUM_SEQS):
        n = int(torch.randint(1, 7, (), generator=gen))
        reward = float(torch.randn((), generator=gen))
        rollouts.append(Rollout(prompt_ids=[1], response_ids=[2] * n, reward=reward, group=i // 3))
        token_rewards = torch.zeros(n)
        token_rewards[-1] = reward
        rewards.append(token_rewards)
        values.append(torch.randn(n, generator=gen))
    return rollouts, rewards, values


def advantages(name, idx, rollouts, rewards, values, sum_across_ranks):
    settings = AdvSettings(gamma=0.9, lam=0.8, whiten_advantages=True)
    adv, _ = estimate_advantages([rewards[i] for i in idx], [values[i] for i in idx], [rollouts[i] for i in idx],
                                 adv_fn=resolve_adv_estimator(name), settings=settings,
                                 sum_across_ranks=sum_across_ranks)
    return {str(i): a.tolist() for i, a in zip(idx, adv)}


@dist_worker()
def main(args, info, record: dict) -> None:
    rollouts, rewards, values = batch()
    mine = [i for i in range(NUM_SEQS) if (i // 3) % info.world_size == info.rank]
    record.update({"ranks": {}, "single": {}})
    for name in ESTIMATORS:
        record["ranks"][name] = advantages(name, mine, rollouts, rewards, values, world.all_reduce_sum)
        record["single"][name] = advantages(name, list(range(NUM_SEQS)), rollouts, rewards, values, lambda s: s)


if __name__ == "__main__":
    main()
