"""Advantage estimators behind one signature: each by hand, global whitening split over ranks, user functions."""

import math

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.registry.names import ADV_ESTIMATORS
from fsdptrain.rl.estimator_registry import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageResult,
    AdvSettings,
    resolve_adv_estimator,
    whiten_stats,
    whitened,
)
from fsdptrain.rl.advantages import gae, grpo_advantages, rloo_advantages

F64 = torch.float64

SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 4.0, 5.0], dtype=F64)
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 11])
MASK7 = torch.tensor([[1, 1, 0]] * 7)  # two response tokens each, one pad


def _call(name, *, rewards=None, values=None, mask=MASK7, scores=SCORES, groups=GROUPS, **settings):
    fn = resolve_adv_estimator(name)
    if rewards is None:
        rewards = torch.zeros(mask.shape, dtype=F64)
    return fn(token_rewards_BT=rewards, values_BT=values, mask_BT=mask, scores_N=scores, group_ids_N=groups,
              settings=AdvSettings(**settings))


def _whiten_over_ranks(result, mask, rank_rows):
    """Whitening as the loop does it: each 'rank' (a row subset) contributes its stats, summed = one all-reduce."""
    summed = sum(whiten_stats(AdvantageResult(result.advantages_BT[rows], None, True), mask[rows])
                 for rows in rank_rows)
    return whitened(result, mask, summed)


def test_registry_keys_are_the_names():
    assert tuple(ADV_ESTIMATOR_REGISTRY) == ADV_ESTIMATORS
    assert all(resolve_adv_estimator(n) is ADV_ESTIMATOR_REGISTRY[n] for n in ADV_ESTIMATORS)


def test_group_estimators_broadcast_and_do_not_whiten():
    grpo = _call("grpo")
    assert not grpo.whiten and grpo.returns_BT is None
    torch.testing.assert_close(grpo.advantages_BT, grpo_advantages(SCORES, GROUPS)[:, None] * MASK7)
    dr = _call("grpo", norm_adv_by_std=False)
    torch.testing.assert_close(dr.advantages_BT[:, 0], torch.tensor([.25, -.75, .25, .25, -1., 1., 0.], dtype=F64))
    rloo = _call("rloo")
    assert not rloo.whiten
    torch.testing.assert_close(rloo.advantages_BT, rloo_advantages(SCORES, GROUPS)[:, None] * MASK7)
    assert rloo.advantages_BT[:, 2].tolist() == [0.0] * 7  # the pad column


def test_gae_matches_the_function_and_follows_the_whiten_setting():
    rewards = torch.tensor([[0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25]], dtype=F64)
    mask = torch.ones(1, 2)
    res = _call("gae", rewards=rewards, values=values, mask=mask, scores=SCORES[:1], groups=GROUPS[:1], gamma=0.5,
                lam=0.5)
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(res.advantages_BT, adv)
    torch.testing.assert_close(res.returns_BT, ret)
    assert res.whiten
    assert not _call("gae", rewards=rewards, values=values, mask=mask, scores=SCORES[:1], groups=GROUPS[:1],
                     whiten_advantages=False).whiten
    with pytest.raises(ValueError, match="use_critic"):
        _call("gae", rewards=rewards, mask=mask, scores=SCORES[:1], groups=GROUPS[:1])


def test_reinforce_plus_plus_by_hand():
    # gamma 0.5. row 0: rewards [0, 0, 1] -> G = [0.25, 0.5, 1]; row 1: [0.5, 2, 9 (masked)] -> G = [1.5, 2, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    res = _call("reinforce_plus_plus", rewards=rewards, mask=mask, scores=SCORES[:2], groups=GROUPS[:2], gamma=0.5)
    g = torch.tensor([[0.25, 0.5, 1.0], [1.5, 2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(res.advantages_BT, g, rtol=0, atol=1e-15)
    torch.testing.assert_close(res.returns_BT, g, rtol=0, atol=1e-15)
    assert res.whiten
    # 5 valid values: sum 5.25, mean 1.05; sum of squares 7.5625; unbiased var (7.5625 - 5 * 1.1025) / 4 = 0.5125
    expected = torch.where(mask != 0, (g - 1.05) / math.sqrt(0.5125 + 1e-8), torch.zeros((), dtype=F64))
    one_rank = _whiten_over_ranks(res, mask, [[0, 1]])
    torch.testing.assert_close(one_rank, expected, rtol=0, atol=1e-12)
    # each row on its own "rank": the summed moments give the same whitening (per-rank moments would not)
    torch.testing.assert_close(_whiten_over_ranks(res, mask, [[0], [1]]), expected, rtol=0, atol=1e-12)


def test_reinforce_plus_plus_baseline_by_hand():
    # centred scores [.25, -.75, .25, .25, -1, 1, 0] (group 11 alone: 0), two tokens each: 14 valid values,
    # mean 0, sum of squares 2 * 2.75 = 5.5, unbiased var 5.5 / 13
    res = _call("reinforce_plus_plus_baseline")
    assert res.whiten and res.returns_BT is None
    centred = torch.tensor([.25, -.75, .25, .25, -1.0, 1.0, 0.0], dtype=F64)
    torch.testing.assert_close(res.advantages_BT, centred[:, None] * MASK7)
    out = _whiten_over_ranks(res, MASK7, [[0, 1, 2, 3], [4, 5, 6]])
    torch.testing.assert_close(out[:, 0], centred / math.sqrt(5.5 / 13 + 1e-8), rtol=0, atol=1e-12)
    assert out[:, 2].tolist() == [0.0] * 7


USER = """
import torch
from fsdptrain.rl.estimator_registry import AdvantageResult

def raw_score(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    return AdvantageResult(scores_N[:, None] * mask_BT, None, False)

def wrong(rewards, mask):
    return rewards
"""


def test_user_estimator_loads_and_runs(tmp_path):
    (tmp_path / "est.py").write_text(USER)
    res = _call(f"{tmp_path}/est.py:raw_score")
    torch.testing.assert_close(res.advantages_BT, SCORES[:, None] * MASK7)


@pytest.mark.parametrize("spec, fragment", [
    ("{dir}/est.py:wrong", "has no parameter 'token_rewards_BT'"),
    ("{dir}/nope.py:f", "not found"),
    ("reinforce", "is not a built-in (gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)"),
])
def test_an_estimator_that_does_not_fit_is_a_config_error(tmp_path, spec, fragment):
    (tmp_path / "est.py").write_text(USER)
    with pytest.raises(ConfigError, match="algorithm.adv_estimator") as err:
        resolve_adv_estimator(spec.format(dir=tmp_path))
    assert fragment in str(err.value)
