"""When the old log-prob pass may be skipped (`skips_old_passes`, docs/performance.md): only when it is exact."""

from __future__ import annotations

import pytest

from fsdptrain.config.compose import compose_config
from fsdptrain.train.setup import skips_old_passes


def test_the_default_on_policy_step_skips_the_pass():
    assert skips_old_passes(compose_config([]))


@pytest.mark.parametrize("override", ["algorithm.ppo_epochs=2", "trainer.mini_batches_per_step=2",
                                      "algorithm.kl_in_reward_coef=0.1", "algorithm.recompute_old_logprobs=always",
                                      "algorithm.rollout_correction=tis", "algorithm.rollout_correction=mis"])
def test_a_step_that_reads_the_old_log_probs_before_the_update_keeps_the_pass(override):
    # Rollout correction: its weights exp(old - behaviour) are made before the update (a skipped pass left them None
    # and the first train step raised AttributeError in the packed loss).
    assert not skips_old_passes(compose_config([override]))
