"""`stale_behaviour` (fsdptrain/rollout/prompt_source.py): what a generator's rollouts carry into the experience."""

from __future__ import annotations

from fsdptrain.data.rollout_record import Rollout
from fsdptrain.rollout.prompt_source import stale_behaviour


def _rollouts() -> list[Rollout]:
    return [Rollout([1, 2], [5, 6], 1.0, 0, generation_logprobs=[-0.5, -1.25]),
            Rollout([3], [7], 0.0, 1, generation_logprobs=[-2.0])]


def test_at_k0_the_rollouts_stay_on_policy():
    rollouts = _rollouts()
    assert stale_behaviour(rollouts, max_staleness=0) is rollouts
    assert all(r.behaviour_logprobs is None for r in rollouts)


def test_at_k1_and_above_the_behaviour_is_the_generating_forward_s():
    for k in (1, 3):
        stale = stale_behaviour(_rollouts(), max_staleness=k)
        assert [r.behaviour_logprobs for r in stale] == [[-0.5, -1.25], [-2.0]]
        assert [r.generation_logprobs for r in stale] == [[-0.5, -1.25], [-2.0]]
