"""check-metrics' experience oracle on the perturbed batch (fsdptrain/check/passes.py), in one process: a wrong sign
of the KL-in-reward penalty (tests/helpers/planted_bugs.py) fails under every estimator that reads the penalised
token rewards: GAE (advantages and returns), REINFORCE++ (its advantages; its returns with a critic) and an outcome
estimator's critic target (the reward-to-go: returns only). GRPO without a critic never reads them, and passes. No
KL-in-reward is configured: the perturbed check then runs the path at its probe coefficient, 0.1."""

from __future__ import annotations

import pytest
import torch

from fsdptrain.check.batch import build_session
from fsdptrain.check.passes import experience_checks
from fsdptrain.check.precision import checked_precision
from fsdptrain.config.compose import compose_config
from fsdptrain.distributed import world
from tests.helpers.planted_bugs import (
    plant_kl_penalty_coefficient_applied_twice,
    plant_kl_penalty_sign_flipped_in_the_reward,
)

PERTURBED = "on the perturbed batch (old, reference, values; KL-in-reward coef 0.1)"
ADVANTAGES, RETURNS = f"experience: advantages = oracle {PERTURBED}", f"experience: returns = oracle {PERTURBED}"
ESTIMATORS = {  # config -> the perturbed checks a wrong penalty fails
    "gae": ((), {ADVANTAGES, RETURNS}),
    "reinforce_plus_plus": (("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_critic=false"),
                            {ADVANTAGES}),
    "grpo_with_critic": (("algorithm=grpo", "algorithm.use_critic=true"), {RETURNS}),
    "grpo": (("algorithm=grpo",), set()),
}


@pytest.fixture(scope="module", params=list(ESTIMATORS))
def session(request):
    torch.set_num_threads(1)
    cfg = compose_config(["trainer.share_prompts=false", *ESTIMATORS[request.param][0]])
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    return request.param, build_session(cfg, info, mesh)


def _failed(session) -> set[str]:
    """The rules of the experience checks that fail (the stage check-metrics runs them in)."""
    with checked_precision(session.cfg):  # float64, as run_checks runs it
        checks, note = experience_checks(session, rtol=session.cfg.check.rtol, atol=session.cfg.check.atol)
    assert note is None and {ADVANTAGES} <= {k.rule for k in checks}
    return {k.rule for k in checks if not k.passed}


def test_passes_without_a_bug(session):
    assert _failed(session[1]) == set()


@pytest.mark.parametrize("plant", [plant_kl_penalty_sign_flipped_in_the_reward,
                                   plant_kl_penalty_coefficient_applied_twice])
def test_a_wrong_kl_penalty_fails_where_the_estimator_reads_it(session, plant, monkeypatch):
    name, checked = session
    plant(monkeypatch.setattr)
    assert _failed(checked) == ESTIMATORS[name][1]
