"""Gradient-scale report: the scale relative to token-mean per mode, the weights and the warnings."""

import pytest

from fsdptrain.rl.grad_scale import grad_scale_report

LENGTHS = [10, 30, 0]  # N = 40 tokens, S = 2 sequences (the empty one counts for nothing), mean length 20


def test_token_mean_is_scale_one_without_warnings():
    r = grad_scale_report("token-mean", seq_lengths=LENGTHS, grad_clip=1.0)
    assert (r.num_tokens, r.num_seqs, r.scale, r.warnings) == (40, 2, 1.0, ())
    assert "mean over all 40 valid tokens" in r.describe()


def test_token_sum_warns_with_the_factor():
    r = grad_scale_report("token-sum", num_tokens=1000, num_seqs=8, grad_clip=None)
    assert r.scale == 1000.0
    assert len(r.warnings) == 1 and "1000x" in r.warnings[0] and "learning rate" in r.warnings[0]
    assert "turn clipping on" in r.warnings[0]
    clipped = grad_scale_report("token-sum", num_tokens=1000, num_seqs=8, grad_clip=1.0)
    assert "clip will bind" in clipped.warnings[0]


def test_seq_mean_token_sum_is_mean_length_and_warns_without_clip():
    r = grad_scale_report("seq-mean-token-sum", seq_lengths=LENGTHS, grad_clip=0.0)
    assert r.scale == 20.0  # N / S = 40 / 2
    assert any("clipping is off" in w for w in r.warnings)
    r = grad_scale_report("seq-mean-token-sum", seq_lengths=LENGTHS, grad_clip=1.0)
    assert any("will likely bind" in w for w in r.warnings)
    assert grad_scale_report("seq-mean-token-sum", seq_lengths=[4, 6]).warnings == ()  # scale 5: fine


def test_norm_mode_scale_and_factor_warning():
    r = grad_scale_report("seq-mean-token-sum-norm", seq_lengths=LENGTHS, loss_scale_factor=20, grad_clip=1.0)
    assert r.scale == 1.0 and r.warnings == ()  # 40 / (2 * 20)
    r = grad_scale_report("seq-mean-token-sum-norm", seq_lengths=LENGTHS, loss_scale_factor=200, grad_clip=1.0)
    assert r.scale == pytest.approx(0.1)
    assert len(r.warnings) == 1 and "10x the mean response length" in r.warnings[0]
    with pytest.raises(ValueError, match="loss_scale_factor"):
        grad_scale_report("seq-mean-token-sum-norm", seq_lengths=LENGTHS)


def test_seq_mean_token_mean_reports_weights():
    # a token of sequence i weighs N / (S * L_i) relative to token-mean: 40 / 20 = 2 (short), 40 / 60 = 2/3 (long)
    r = grad_scale_report("seq-mean-token-mean", seq_lengths=LENGTHS, dp_size=4, grad_clip=1.0)
    assert r.scale is None
    assert r.max_token_weight == pytest.approx(2.0) and r.min_token_weight == pytest.approx(2 / 3)
    text = r.describe()
    assert "0.6667x to 2x" in text and "4 data-parallel ranks" in text


def test_bad_inputs():
    with pytest.raises(ValueError, match="choose one of"):
        grad_scale_report("mean", seq_lengths=LENGTHS)
    with pytest.raises(ValueError, match="seq_lengths"):
        grad_scale_report("token-mean")
    with pytest.raises(ValueError, match="seq_lengths"):
        grad_scale_report("seq-mean-token-mean", num_tokens=10, num_seqs=2)
