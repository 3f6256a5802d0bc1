"""Policy-gradient terms beyond vanilla PPO, each by hand; the registry; a user's loss loaded by name."""

import math

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.registry.names import POLICY_LOSSES
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import Kind, finalize
from fsdptrain.rl.pg_terms import (
    POLICY_LOSS_REGISTRY,
    cispo_policy_loss,
    dro_policy_loss,
    gmpo_policy_loss,
    resolve_policy_loss,
    vanilla_policy_loss,
)
from fsdptrain.rl.policy_loss import policy_loss

F64 = torch.float64
LOG = math.log


def _run(fn, logp_rows, old_rows, adv_rows, mask_rows, mode, n_tok, n_seq, cu_seqlens=None, **kw):
    kw.setdefault("dro_beta", 1.0)  # DRO has no default; the other terms ignore it
    logp = torch.tensor(logp_rows, dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.tensor(old_rows, dtype=F64), torch.tensor(adv_rows, dtype=F64),
                                torch.tensor(mask_rows), norms=LossNormalizers(n_tok, n_seq), agg_mode=mode,
                                clip_ratio_low=kw.pop("low", 0.2), clip_ratio_high=kw.pop("high", 0.3),
                                pg_loss_fn=fn, cu_seqlens=cu_seqlens, **kw)
    loss.backward()
    return loss.item(), finalize(metrics), logp.grad, metrics


def test_registry_keys_are_the_names():
    assert tuple(POLICY_LOSS_REGISTRY) == POLICY_LOSSES
    assert POLICY_LOSS_REGISTRY["vanilla"] is vanilla_policy_loss
    assert all(resolve_policy_loss(name) is POLICY_LOSS_REGISTRY[name] for name in POLICY_LOSSES)


def test_cispo_by_hand():
    # r = [1.5, 0.5, 1.1], old = -1, A = [1, -1, 2], clip [0.8, 1.3] -> w = sg[1.3, 0.8, 1.1]
    # pg = -w A logp: [1.3 (1 - ln 1.5), 0.8 (-1 + ln 0.5), 2.2 (1 - ln 1.1)]; d/dlogp = -w A = [-1.3, 0.8, -2.2]
    ratios = [1.5, 0.5, 1.1]
    logp = [[-1.0 + LOG(r) for r in ratios]]
    loss, out, grad, metrics = _run(cispo_policy_loss, logp, [[-1.0] * 3], [[1.0, -1.0, 2.0]], [[1, 1, 1]],
                                    "token-mean", 3, 1)
    expected = (1.3 * (1 - LOG(1.5)) + 0.8 * (-1 + LOG(0.5)) + 2.2 * (1 - LOG(1.1))) / 3
    assert loss == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-1.3, 0.8, -2.2]], dtype=F64) / 3, rtol=0, atol=1e-12)
    assert out["pg_clipfrac"] == pytest.approx(2 / 3) and out["pg_clipfrac_lower"] == 0.0
    assert out["probs_ratio_max"] == pytest.approx(1.5) and out["probs_ratio_min"] == pytest.approx(0.5)
    assert out["pg_loss"] == pytest.approx(expected, abs=1e-12)
    assert metrics["pg_loss"].kind is Kind.LOSS and metrics["pg_clipfrac"].kind is Kind.MEAN


# GMPO, clip_ratio_low = clip_ratio_high = 0.4 (log space), seq-mean-token-mean:
#   seq 0: A = 1, d = [0.5, -0.5, 0.1] -> A > 0 caps at 0.4: [0.4, -0.5, 0.1], mean 0, R = 1, loss -1
#          d loss / d logp_t = -A R / 3 on unclipped tokens: [0, -1/3, -1/3]
#   seq 1: A = -2, d = [-0.6, 0.2, masked] -> A < 0 floors at -0.4: [-0.4, 0.2], mean -0.1, R = e^-0.1,
#          loss 2 e^-0.1; grad -A R / 2 on unclipped: [0, e^-0.1, 0]
#   mini-batch: (-1 + 2 e^-0.1) / 2, gradients halved; 2 of 5 valid tokens clipped
GM_OLD = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
GM_LOGP = [[-0.5, -1.5, -0.9], [-1.6, -0.8, 5.0]]
GM_ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, 7.0]]
GM_MASK = [[1, 1, 1], [1, 1, 0]]


def test_gmpo_by_hand():
    loss, out, grad, _ = _run(gmpo_policy_loss, GM_LOGP, GM_OLD, GM_ADV, GM_MASK, "seq-mean-token-mean", 5, 2,
                              low=0.4, high=0.4)
    e = math.exp(-0.1)
    assert loss == pytest.approx((-1 + 2 * e) / 2, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1 / 3, -1 / 3], [0.0, e, 0.0]], dtype=F64) / 2,
                               rtol=0, atol=1e-12)
    assert out["pg_clipfrac"] == pytest.approx(0.4)
    assert out["probs_ratio_mean"] == pytest.approx((3 + 2 * e) / 5)
    assert (out["probs_ratio_min"], out["probs_ratio_max"]) == pytest.approx((e, 1.0))


def test_gmpo_packed_equals_padded():
    padded = _run(gmpo_policy_loss, GM_LOGP, GM_OLD, GM_ADV, GM_MASK, "seq-mean-token-mean", 5, 2,
                  low=0.4, high=0.4)
    flat = lambda rows: [rows[0] + rows[1][:2] + [0.0]]  # noqa: E731  (a padding tail after the last sequence)
    packed = _run(gmpo_policy_loss, flat(GM_LOGP), flat(GM_OLD), flat(GM_ADV), [[1] * 6], "seq-mean-token-mean",
                  5, 2, cu_seqlens=torch.tensor([0, 3, 5]), low=0.4, high=0.4)
    assert packed[0] == pytest.approx(padded[0], abs=1e-12)
    torch.testing.assert_close(packed[2][0, :5], torch.cat([padded[2][0], padded[2][1, :2]]), rtol=0, atol=1e-12)
    assert packed[1] == pytest.approx(padded[1])


def test_dro_needs_a_beta():
    with pytest.raises(ValueError, match="the dro loss needs dro_beta"):
        _run(dro_policy_loss, [[-1.0]], [[-1.0]], [[1.0]], [[1]], "token-mean", 1, 1, dro_beta=None)


def test_dro_by_hand():
    # beta = 0.5, old = -1, logp = [-0.5, -2], A = [1, -1], d = [0.5, -1]
    # pg = -(A logp - beta/2 d^2) = [0.5 + 0.0625, -2 + 0.25] = [0.5625, -1.75]; grad -A + beta d = [-0.75, 0.5]
    loss, out, grad, _ = _run(dro_policy_loss, [[-0.5, -2.0]], [[-1.0, -1.0]], [[1.0, -1.0]], [[1, 1]],
                              "token-sum", 2, 1, dro_beta=0.5)
    assert loss == pytest.approx(0.5625 - 1.75, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-0.75, 0.5]], dtype=F64), rtol=0, atol=1e-12)
    assert out["pg_clipfrac"] == 0.0
    assert out["ppo_kl"] == pytest.approx((-0.5 + 1.0) / 2)  # old - logp = [-0.5, 1]
    assert out["probs_ratio_max"] == pytest.approx(math.exp(0.5))


@pytest.mark.parametrize("name", ["cispo", "gmpo", "dro"])
def test_gspo_ratio_is_refused_and_dual_clip_ignored_outside_vanilla(name):
    with pytest.raises(ValueError, match="seq_level_ratio=false"):
        _run(POLICY_LOSS_REGISTRY[name], [[-1.0]], [[-1.0]], [[1.0]], [[1]], "token-mean", 1, 1,
             seq_level_ratio=True)
    # the config's default dual-clip bound changes nothing: A = -1, r = 5 would be dual-clipped by vanilla
    args = ([[-1.0 + LOG(5.0)]], [[-1.0]], [[-1.0]], [[1]], "token-mean", 1, 1)
    assert _run(POLICY_LOSS_REGISTRY[name], *args, clip_ratio_c=3.0)[0] == _run(POLICY_LOSS_REGISTRY[name], *args)[0]


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_every_builtin_returns_the_same_names_when_empty(name):
    kw = {"clip_ratio_c": 3.0} if name == "vanilla" else {}
    full = _run(POLICY_LOSS_REGISTRY[name], [[-1.0, -2.0]], [[-1.5, -1.0]], [[1.0, 1.0]], [[1, 1]],
                "token-mean", 2, 1, **kw)[3]
    empty = _run(POLICY_LOSS_REGISTRY[name], [[-1.0, -2.0]], [[-1.5, -1.0]], [[1.0, 1.0]], [[0, 0]],
                 "token-mean", 2, 1, **kw)
    assert set(full) == set(empty[3]) and empty[0] == 0.0
    assert {m: full[m].kind for m in full} == {m: empty[3][m].kind for m in empty[3]}


REINFORCE = """
from fsdptrain.metrics.typed import Metrics, Sum

def reinforce(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    return -advantages * logprobs, Metrics({"num_valid": Sum(valid.sum())})

def wrong(logprobs, advantages):
    return -advantages * logprobs

def bad_shape(logprobs, old_logprobs, advantages, valid, layout, settings):
    return (-advantages * logprobs).sum(), Metrics()
"""


def test_user_loss_loads_and_runs(tmp_path):
    path = tmp_path / "my_loss.py"
    path.write_text(REINFORCE)
    fn = resolve_policy_loss(f"{path}:reinforce")
    # -A logp, token-mean over 2: (-(1)(-0.5) - (-1)(-2)) / 2 = (0.5 - 2) / 2; grad -A / 2
    loss, out, grad, _ = _run(fn, [[-0.5, -2.0]], [[-1.0, -1.0]], [[1.0, -1.0]], [[1, 1]], "token-mean", 2, 1)
    assert loss == pytest.approx(-0.75, abs=1e-12) and out["num_valid"] == 2.0
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]], dtype=F64))
    bad = resolve_policy_loss(f"{path}:bad_shape")  # the signature fits; the result does not
    with pytest.raises(ValueError, match="per-token loss in the shape of logprobs"):
        _run(bad, [[-0.5, -2.0]], [[-1.0, -1.0]], [[1.0, -1.0]], [[1, 1]], "token-mean", 2, 1)


@pytest.mark.parametrize("spec, fragment", [
    ("{path}:wrong", "has no parameter 'old_logprobs'"),
    ("{path}:missing", "has no attribute 'missing'"),
    ("ppo", "is not a built-in (vanilla, cispo, gmpo, dro)"),
])
def test_a_loss_that_does_not_fit_is_a_config_error(tmp_path, spec, fragment):
    path = tmp_path / "my_loss.py"
    path.write_text(REINFORCE)
    with pytest.raises(ConfigError, match="algorithm.policy_loss") as err:
        resolve_policy_loss(spec.format(path=path))
    assert fragment in str(err.value)
