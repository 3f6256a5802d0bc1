"""Scaling reward-model scores: hand-computed batch and running normalisation, clipping, a resume of the running
state, two ranks' moments == one process, and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.metrics.typed import Kind, finalize, merge
from fsdptrain.rl.reward_scale import RunningMoments, combine, scale_scores, score_metrics, score_moments

SCORES = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
# sum 10, sum of squares 30, count 4: mean 2.5, unbiased variance (30 - 4 * 2.5^2) / 3 = 5/3
NONE = RunningMoments()


def test_moments():
    assert score_moments(SCORES).tolist() == [10.0, 30.0, 4.0]


def test_none_is_the_identity_and_keeps_the_running_state():
    state = RunningMoments(3.0, 1.0, 2.0)
    out, after = scale_scores(SCORES, mode="none", global_moments=score_moments(SCORES), running=state, clip=None)
    assert out.tolist() == SCORES.tolist() and after == state


def test_batch_whitens_with_the_global_moments():
    out, after = scale_scores(SCORES, mode="batch", global_moments=score_moments(SCORES), running=NONE, clip=None,
                              eps=0.0)
    std = math.sqrt(5 / 3)
    torch.testing.assert_close(out, torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64) / std,
                               rtol=0, atol=1e-12)
    assert after == NONE


def test_two_ranks_with_summed_moments_equal_one_process():
    a, b = SCORES[:1], SCORES[1:]
    moments = score_moments(a) + score_moments(b)  # what the loop's all-reduce(SUM) gives
    whole, _ = scale_scores(SCORES, mode="batch", global_moments=score_moments(SCORES), running=NONE, clip=None)
    out_a, _ = scale_scores(a, mode="batch", global_moments=moments, running=NONE, clip=None)
    out_b, _ = scale_scores(b, mode="batch", global_moments=moments, running=NONE, clip=None)
    torch.testing.assert_close(torch.cat([out_a, out_b]), whole, rtol=0, atol=1e-12)


def test_running_merges_batches_exactly_and_resumes():
    # step 1: [1, 2, 3, 4] -> count 4, mean 2.5, m2 = 2.25 + 0.25 + 0.25 + 2.25 = 5
    _, state = scale_scores(SCORES, mode="running", global_moments=score_moments(SCORES), running=NONE, clip=None)
    assert state == RunningMoments(4.0, 2.5, 5.0)
    # a checkpoint in between: the state is three plain floats
    saved = state.state_dict()
    assert saved == {"count": 4.0, "mean": 2.5, "m2": 5.0}
    resumed = RunningMoments.from_state_dict(saved)
    # step 2: [10] -> count 5, mean 2.5 + 7.5 / 5 = 4, m2 = 5 + 7.5^2 * 4 * 1 / 5 = 50 (the m2 of 1, 2, 3, 4, 10:
    # 9 + 4 + 1 + 0 + 36 = 50); unbiased variance 50 / 4 = 12.5
    step2 = torch.tensor([10.0], dtype=torch.float64)
    out, after = scale_scores(step2, mode="running", global_moments=score_moments(step2), running=resumed,
                              clip=None, eps=0.0)
    assert after == RunningMoments(5.0, 4.0, 50.0)
    assert out.tolist() == pytest.approx([6.0 / math.sqrt(12.5)], abs=1e-12)


def test_running_with_one_score_only_centres():
    one = torch.tensor([3.0], dtype=torch.float64)
    out, state = scale_scores(one, mode="running", global_moments=score_moments(one), running=NONE, clip=None,
                              eps=0.0)
    assert state == RunningMoments(1.0, 3.0, 0.0) and out.tolist() == [0.0]


def test_clip_bounds_the_normalised_scores():
    out, _ = scale_scores(SCORES, mode="batch", global_moments=score_moments(SCORES), running=NONE, clip=1.0)
    assert out.tolist() == pytest.approx([-1.0, -0.5 / math.sqrt(5 / 3), 0.5 / math.sqrt(5 / 3), 1.0], abs=1e-7)
    raw, _ = scale_scores(SCORES, mode="none", global_moments=score_moments(SCORES), running=NONE, clip=2.5)
    assert raw.tolist() == [1.0, 2.0, 2.5, 2.5]


@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="zscore", clip=None), "reward.model_normalize='zscore'"),
    (dict(mode="none", clip=0.0), "reward.model_clip=0.0"),
    (dict(mode="batch", clip=None, scores=torch.tensor([1.0])), "at least 2 sequences"),
])
def test_settings_a_user_can_get_wrong(kwargs, words):
    scores = kwargs.pop("scores", SCORES)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("?", r"\?")):
        scale_scores(scores, global_moments=score_moments(scores), running=NONE, **kwargs)


def test_metrics_are_typed_and_merge_exactly():
    scaled = torch.tensor([-1.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    whole = score_metrics(SCORES, scaled, prefix="rm0/")
    halves = merge(score_metrics(SCORES[:3], scaled[:3], prefix="rm0/"),
                   score_metrics(SCORES[3:], scaled[3:], prefix="rm0/"))
    kinds = {name: metric.kind for name, metric in whole.items()}
    assert kinds["rm0/raw/mean"] is Kind.MEAN and kinds["rm0/raw/std"] is Kind.DERIVED
    assert kinds["rm0/scaled/min"] is Kind.MIN and kinds["rm0/scaled/max"] is Kind.MAX
    want = {
        "rm0/raw/mean": 2.5, "rm0/raw/std": math.sqrt(1.25), "rm0/raw/min": 1.0, "rm0/raw/max": 4.0,
        # population std of -1, 0, 1, 2: mean 0.5, mean square 1.5, variance 1.25
        "rm0/scaled/mean": 0.5, "rm0/scaled/std": math.sqrt(1.25), "rm0/scaled/min": -1.0, "rm0/scaled/max": 2.0,
    }
    for got in (finalize(whole), finalize(halves)):
        assert got == pytest.approx(want, abs=1e-12)


def test_metrics_of_a_rank_without_sequences_are_empty_not_zero():
    empty = torch.zeros(0, dtype=torch.float64)
    assert finalize(score_metrics(empty, empty, prefix="")) == {}


def test_combine_weights_several_reward_models():
    out = combine([torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])], [0.5, 2.0])
    assert out.tolist() == [6.5, -1.0]
    with pytest.raises(ConfigError, match="2 weights for 1 reward models"):
        combine([torch.tensor([1.0])], [1.0, 2.0])
