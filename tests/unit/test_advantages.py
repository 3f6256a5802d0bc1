"""Advantages: GAE, whitening statistics, GRPO and RLOO, all worked by hand."""

import math

import pytest
import torch

from fsdptrain.rl.advantages import gae, grpo_advantages, mean_var, moment_stats, rloo_advantages, whiten

F64 = torch.float64

# gamma 0.9, lam 0.8 (gamma * lam = 0.72) over valid steps with rewards [0, 0, 1], values [0.5, 0.6, 0.7]:
#   t2: delta = 1 + 0.9 * 0 - 0.7 = 0.3                A = 0.3
#   t1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03             A = 0.03 + 0.72 * 0.3 = 0.246
#   t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04             A = 0.04 + 0.72 * 0.246 = 0.21712
# returns = A + V = [0.71712, 0.846, 1.0]
ADV = [0.21712, 0.246, 0.3]
RET = [0.71712, 0.846, 1.0]


def test_gae_by_hand_with_masked_tail_and_hole():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 7.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.5, math.nan, 0.6, 0.7]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: the value 9 and reward 5 after the last valid token never leak in
    torch.testing.assert_close(adv[0], torch.tensor(ADV + [0.0], dtype=F64))
    torch.testing.assert_close(ret[0], torch.tensor(RET + [0.0], dtype=F64))
    # row 1: the same three valid steps around a masked hole (reward 7, NaN value skipped)
    torch.testing.assert_close(adv[1], torch.tensor([ADV[0], 0.0, ADV[1], ADV[2]], dtype=F64))
    torch.testing.assert_close(ret[1], torch.tensor([RET[0], 0.0, RET[1], RET[2]], dtype=F64))


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25, 0.125]], dtype=F64)
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[6.0, 5.0, 3.0]], dtype=F64))  # reward-to-go
    torch.testing.assert_close(adv, ret - values)


def test_whitening_from_additive_stats():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s, sq, n = moment_stats(x, mask)
    assert (s.item(), sq.item(), n.item()) == (6.0, 14.0, 3.0)
    # two "ranks" summed give the same statistics
    s0, sq0, n0 = moment_stats(x[:1], mask[:1])
    s1, sq1, n1 = moment_stats(x[1:], mask[1:])
    mean, var = mean_var(s0 + s1, sq0 + sq1, n0 + n1)
    assert mean.item() == 2.0 and var.item() == 1.0  # unbiased: (14 - 3 * 4) / 2
    out = whiten(x, mask, mean=mean, var=var, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64))
    out = whiten(x, mask, mean=mean, var=var, eps=0.0, shift_mean=False)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], dtype=F64))
    assert mean_var(6.0, 14.0, 3.0, unbiased=False)[1].item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="at least 2"):
        mean_var(1.0, 1.0, 1.0)


SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 4.0, 5.0], dtype=F64)
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 11])


def test_grpo_with_std():
    # group 7: [1, 0, 1, 1], mean 0.75, deviations [.25, -.75, .25, .25], unbiased var 0.75 / 3 = 0.25, std 0.5
    # group 3: [2, 4], mean 3, deviations [-1, 1], unbiased var 2, std sqrt(2); group 11 alone: 0
    adv = grpo_advantages(SCORES, GROUPS)
    e = 1e-6
    expected = [0.25 / (0.5 + e), -0.75 / (0.5 + e), 0.25 / (0.5 + e), 0.25 / (0.5 + e),
                -1 / (math.sqrt(2) + e), 1 / (math.sqrt(2) + e), 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


def test_grpo_without_std():
    adv = grpo_advantages(SCORES, GROUPS, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.75, 0.25, 0.25, -1.0, 1.0, 0.0], dtype=F64))


def test_grpo_identical_scores_give_zero():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_rloo():
    # group 7: 1 - (0 + 1 + 1) / 3 = 1/3; 0 - 3/3 = -1; group 3: 2 - 4 = -2, 4 - 2 = 2; group of one: 0
    adv = rloo_advantages(SCORES, GROUPS)
    torch.testing.assert_close(adv, torch.tensor([1 / 3, -1.0, 1 / 3, 1 / 3, -2.0, 2.0, 0.0], dtype=F64))


# ---- GAE over the policy's tokens (multi-turn: a tool's tokens are masked out) --------------------------------------
# mask [1, 1, 0, 0, 1] (a tool wrote tokens 2 and 3), rewards [0, 0, 5, 7, 1], values [0.5, 1.0, 9, 9, 2.0],
# gamma 0.9, lam 0.8: time runs over tokens 0, 1, 4; the value after token 1 is token 4's (the tool's reply is part
# of that transition), the tool tokens' rewards and values are never read:
#   t4: delta = 1 + 0.9 * 0 - 2.0 = -1.0              A = -1.0
#   t1: delta = 0 + 0.9 * 2.0 - 1.0 = 0.8             A = 0.8 + 0.72 * -1.0 = 0.08
#   t0: delta = 0 + 0.9 * 1.0 - 0.5 = 0.4             A = 0.4 + 0.72 * 0.08 = 0.4576
# returns = A + V at policy tokens, 0 at the tool's: [0.9576, 1.08, 0, 0, 1.0]
TOOL_MASK = torch.tensor([[1, 1, 0, 0, 1]])
TOOL_REWARDS = torch.tensor([[0.0, 0.0, 5.0, 7.0, 1.0]], dtype=F64)
TOOL_VALUES = torch.tensor([[0.5, 1.0, 9.0, 9.0, 2.0]], dtype=F64)


def test_gae_over_policy_tokens_by_hand():
    adv, ret = gae(TOOL_REWARDS, TOOL_VALUES, TOOL_MASK, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.4576, 0.08, 0.0, 0.0, -1.0]], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor([[0.9576, 1.08, 0.0, 0.0, 1.0]], dtype=F64), rtol=0, atol=1e-12)


def test_gae_over_policy_tokens_is_plain_gae_with_the_tool_tokens_cut_out():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 0, 0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 1, 1, 0, 0, 0]])  # the second ends in a tool
    rewards = torch.randn(mask.shape, generator=gen, dtype=F64)
    values = torch.randn(mask.shape, generator=gen, dtype=F64)
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=0.7)
    for b in range(mask.shape[0]):
        keep = mask[b].bool()
        plain_adv, plain_ret = gae(rewards[b, keep][None], values[b, keep][None], torch.ones(1, int(keep.sum())),
                                   gamma=0.95, lam=0.7)
        torch.testing.assert_close(adv[b, keep], plain_adv[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[b, keep], plain_ret[0], rtol=0, atol=1e-12)
        assert adv[b, ~keep].abs().sum() == 0 and ret[b, ~keep].abs().sum() == 0


def test_the_outcome_reward_sits_on_the_last_policy_token():
    from fsdptrain.data.rollout_record import Rollout
    from fsdptrain.train.experience import rollout_masks, token_rewards

    rollouts = [Rollout(prompt_ids=[1], response_ids=[5, 6, 7, 8], reward=2.0, group=0, response_mask=[1, 0, 1, 0]),
                Rollout(prompt_ids=[1], response_ids=[5, 6], reward=3.0, group=0),
                Rollout(prompt_ids=[1], response_ids=[5, 6], reward=4.0, group=0, response_mask=[0, 0])]
    kl = [torch.tensor([0.5, 9.0, 0.25, 9.0]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])]
    rewards = token_rewards(rollouts, kl_R=kl, kl_coef=0.1, masks=rollout_masks(rollouts))
    # a cut tool segment at the end: the reward goes to token 2, the tool tokens get no reward and no KL
    torch.testing.assert_close(rewards[0], torch.tensor([-0.05, 0.0, 2.0 - 0.025, 0.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(rewards[1], torch.tensor([-0.1, 3.0 - 0.2]), rtol=0, atol=1e-7)
    torch.testing.assert_close(rewards[2], torch.zeros(2), rtol=0, atol=0)  # no policy token: nowhere to put it
