"""check-metrics in one process: the mode matrix on one experience batch, and each planted bug class caught.

The sessions (models + one mini-batch of experience of the default config, 4 prompt groups x 4 samples plus the
prompt-only fixture) are built once per module; each test reruns the layouts with another loss mode or with a bug
planted through monkeypatch, in process. Small hand-checked tests of the comparison rules come first.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf

from fsdptrain.check.batch import build_session, make_batch
from fsdptrain.check.compare import Outcome, compare, self_checks
from fsdptrain.check import layouts
from fsdptrain.check import run as run_module
from fsdptrain.check.layouts import reduce_like_ranks
from fsdptrain.check.reference import Counts, explained_variance_direct, seq_share
from fsdptrain.check.run import run_checks
from fsdptrain.check.update_pass import _merge
from fsdptrain.config.compose import compose_config
from fsdptrain.data import shared_prompts
from fsdptrain.distributed import world
from fsdptrain.model import attention_backends
from fsdptrain.model.loading import decoder_layers
from fsdptrain.rl import aggregate, policy_loss, value_loss
from fsdptrain.rl.aggregate import AGG_MODES, LossNormalizers, count_tokens_and_seqs
from fsdptrain.metrics.typed import Kind, Max, Mean, Metrics, Min, finalize
from tests.helpers.planted_bugs import (
    plant_capped_response_not_truncated,
    plant_eos_cut_off_the_response,
    plant_loss_on_tool_tokens,
    plant_normaliser_over_the_whole_step,
    plant_rejected_tokens_in_the_normaliser,
    plant_sequence_weight_from_mean_log_ratio,
    plant_tool_tokens_in_the_normaliser,
)

# ---- the rules, by hand --------------------------------------------------------------------------------------------


def test_update_merge_takes_every_update_s_names_and_an_empty_update_s_zero_loss():
    # updates [empty, 3 tokens, empty, 1 token]: rejection left the first and third with no counted token, so they
    # carry only their losses (0); each name comes from whichever update has it, the means pooled over tokens
    per_update = [{"pg_loss": 0.0}, {"pg_loss": -0.4, "entropy": 2.0, "probs_ratio_max": 1.5},
                  {"pg_loss": 0.0}, {"pg_loss": 0.8, "entropy": 6.0, "probs_ratio_max": 1.25}]
    merged = _merge(per_update, [0, 3, 0, 1], "actor/")
    assert merged == {"actor/pg_loss": pytest.approx(0.1, abs=1e-15), "actor/entropy": 3.0,
                      "actor/probs_ratio_max": 1.5}


def test_seq_share_follows_the_contract_by_hand():
    # sequence (1, 2, 3) in a batch of N = 10 tokens, S = 4 sequences, factor 5:
    # token-mean 6/10; token-sum 6; seq-mean-token-sum 6/4; -norm 6/4/5; seq-mean-token-mean (6/3)/4
    counts = Counts(num_tokens=10, num_seqs=4, loss_scale_factor=5.0)
    x = torch.tensor([1.0, 2.0, 3.0])
    want = {"token-mean": 0.6, "token-sum": 6.0, "seq-mean-token-sum": 1.5, "seq-mean-token-sum-norm": 0.3,
            "seq-mean-token-mean": 0.5}
    for mode, expected in want.items():
        assert float(seq_share(x, mode, counts)) == pytest.approx(expected, abs=1e-15)
    assert float(seq_share(torch.zeros(0), "token-mean", counts)) == 0.0


def test_explained_variance_direct_by_hand():
    # R = (0, 2): Var(R) = 1; v = (0, 1): R - v = (0, 1), Var = 0.25; 1 - 0.25 = 0.75
    assert explained_variance_direct(torch.tensor([0.0, 2.0], dtype=torch.float64),
                                     torch.tensor([0.0, 1.0], dtype=torch.float64)) == pytest.approx(0.75, abs=1e-15)
    assert explained_variance_direct(torch.full((3,), 0.5, dtype=torch.float64), torch.zeros(3)) is None


def test_compare_tolerance_missing_values_and_scales():
    ref = Outcome("reference", {"actor/a": 2.0, "actor/b": 1.0, "actor/grad_max_diff": 0.0}, covers=())
    got = Outcome("layout", {"actor/a": 2.0 + 1.9e-5, "actor/grad_max_diff": 3e-5, "actor/extra": 1.0})
    # a: |diff| 1.9e-5 <= 1e-6 + 1e-5 * 2 = 2.1e-5; grad_max_diff: 3e-5 <= 1e-6 + 1e-5 * 10 (its scale) = 1.01e-4;
    # b: absent in the layout; extra: absent in the reference
    result = {c.metric: c for c in compare(ref, got, rtol=1e-5, atol=1e-6, scales={"actor/grad_max_diff": 10.0})}
    assert result["actor/a"].passed and result["actor/grad_max_diff"].passed
    assert result["actor/grad_max_diff"].rel_diff == pytest.approx(3e-6, rel=1e-12)
    assert not result["actor/b"].passed and result["actor/b"].value is None
    assert not result["actor/extra"].passed and result["actor/extra"].reference is None
    tight = compare(ref, Outcome("layout", {"actor/a": 2.0 + 2.2e-5, "actor/b": 1.0, "actor/grad_max_diff": 0.0}),
                    rtol=1e-5, atol=1e-6, scales={})
    assert [c.metric for c in tight if not c.passed] == ["actor/a"]


def test_self_checks_catch_inconsistent_results():
    bad = Outcome("layout", {"actor/probs_ratio_min": 1.2, "actor/probs_ratio_mean": 1.0,
                             "actor/probs_ratio_max": 1.3, "critic/vf_clipfrac": 1.5, "batch/num_seqs": 16.5},
                  kinds={"batch/num_seqs": Kind.SUM})
    failed = {k.rule for k in self_checks(bad, rtol=1e-5, atol=1e-6, on_policy=True) if not k.passed}
    assert failed == {"actor/probs_ratio: min <= mean <= max", "critic/vf_clipfrac in [0, 1]",
                      "batch/num_seqs is a whole count", "on-policy: max |ratio - 1| = 0"}


def test_reduce_like_ranks_takes_extrema_and_pools_means():
    a = Metrics({"m": Mean(3.0, 2.0), "lo": Min(-1.0), "hi": Max(2.0)})
    b = Metrics({"m": Mean(1.0, 2.0), "lo": Min(), "hi": Max(5.0)})  # an empty MIN is the identity
    assert finalize(reduce_like_ranks([a, b])) == {"m": 1.0, "lo": -1.0, "hi": 5.0}


# ---- the product on one experience batch ---------------------------------------------------------------------------


def _session(*overrides: str):
    torch.set_num_threads(1)
    cfg = compose_config(list(overrides))
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    return build_session(cfg, info, mesh)


# rollout.engine=generate: the planted bugs below are asserted on the layouts where they show in generate's batch
# (with the continuous engine's batch the per-micro-batch token-mean bug shows on other layouts, not on
# micro-batches=2); the continuous engine's batch has its own fixture (`continuous`, at the end).
GENERATE = "rollout.engine=generate"


@pytest.fixture(scope="module")
def ppo():
    return _session("trainer.share_prompts=false", GENERATE)  # CI time: the shared layouts run in the slow test


@pytest.fixture(scope="module")
def grpo():
    return _session("algorithm=grpo", "trainer.share_prompts=false", GENERATE)


def _one_each(session) -> str:
    return f"[micro-batches={session.batch.full.num_seqs} (one sequence each)]"


def test_batch_has_the_fixtures(ppo):
    batch, cfg = ppo.batch, ppo.cfg
    assert batch.full.num_seqs == cfg.check.num_prompts * cfg.rollout.n + 1  # groups x samples + the fixture
    assert batch.full.responses[-1] == [] and all(batch.full.responses[:-1])
    assert batch.value_shift is not None
    assert batch.on_policy
    # the multi-turn fixture: tool segments inside some responses, one cut at the end of others, none in the rest
    masks = batch.policy_masks[:-1]
    assert any(not m[-1] for m in masks) and any(m[-1] and not all(m) for m in masks)
    assert any(all(m) for m in masks)
    for target, mask in zip(batch.full.targets, masks):  # the product's targets carry the rollout's mask
        assert (target.response_mask is None and all(mask)) or target.response_mask.tolist() == mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_policy_and_critic_pass_every_mode(ppo, mode):
    report = run_checks(ppo, mode, update=False)
    assert report.ok, "\n".join(report.failures)
    ref = report.reference.values
    assert ref["critic/values_max"] < -0.99  # the value shift makes every value negative (<= -1 up to rounding)
    assert ref["actor/grad_norm"] > 0 and ref["critic/grad_norm"] > 0  # the gradient comparisons are not vacuous
    layouts = {c.layout for c in report.comparisons}
    assert {"per-sequence", "padded", "micro-batches=2", "simulated dp=2", "ranks=1"} <= layouts
    # every layout is compared on every policy and critic metric of the reference
    for layout in layouts - {"token-mean, same batch", "experience", "mini-batches=2 x epochs=2"}:
        names = {c.metric for c in report.comparisons if c.layout == layout}
        prefix = "off-policy/" if layout.startswith("off-policy: ") else ""
        assert {n for n in ref if n.startswith((prefix + "actor/", prefix + "critic/"))} <= names, layout


@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_passes_every_mode(grpo, mode):
    report = run_checks(grpo, mode)
    assert report.ok, "\n".join(report.failures)
    assert not any(c.metric.startswith("critic/") for c in report.comparisons)
    assert report.reference.values["actor/grad_norm"] > 0


def test_token_sum_gradient_is_n_times_token_mean(ppo):
    report = run_checks(ppo, "token-sum")
    num_tokens = sum(sum(m) for m in ppo.batch.counted_masks())  # the policy's tokens, the tools' left out
    assert num_tokens < sum(len(r) for r in ppo.batch.full.responses)
    assert report.reference.values["grad_scale/actor"] == num_tokens
    measured = next(c for c in report.comparisons if c.metric == "grad_scale/actor")
    assert measured.value == pytest.approx(num_tokens, rel=1e-5)


# ---- planted bugs -----------------------------------------------------------------------------------------------


def _failing(report) -> str:
    assert not report.ok, "the planted bug was not caught"
    return "\n".join(report.failures)


def test_catches_min_summed_across_packs(ppo, monkeypatch):
    monkeypatch.setattr(Min, "merge", lambda self, other: Min(self.extreme + other.extreme))
    failures = _failing(run_checks(ppo, update=False))
    assert "actor/probs_ratio_min [micro-batches=2]" in failures
    assert "critic/values_min [per-sequence]" in failures


def test_catches_a_zero_sentinel_for_empty_extrema(ppo, monkeypatch):
    def min_of(values, valid):
        if not bool(valid.any()):
            return Min(0.0)
        return Min(torch.where(valid, values.detach(), torch.tensor(math.inf, dtype=values.dtype)).amin())

    def max_of(values, valid):
        if not bool(valid.any()):
            return Max(0.0)
        return Max(torch.where(valid, values.detach(), torch.tensor(-math.inf, dtype=values.dtype)).amax())

    monkeypatch.setattr(Min, "of", staticmethod(min_of))
    monkeypatch.setattr(Max, "of", staticmethod(max_of))
    failures = _failing(run_checks(ppo, update=False))
    # the prompt-only fixture runs alone one sequence at a time: its 0.0 wins the min of ratios (~1)
    # and the max of the (shifted, negative) values
    assert "actor/probs_ratio_min [per-sequence]" in failures
    assert f"critic/values_max {_one_each(ppo)}" in failures
    assert f"actor/probs_ratio_min [packed budget={ppo.cfg.trainer.token_budget}]" not in failures  # one full pack


def _local_counts_agg(original):
    def agg(loss_mat, loss_mask, mode, norms, *, cu_seqlens=None):
        tokens, seqs = count_tokens_and_seqs(loss_mask, cu_seqlens)
        local = LossNormalizers(tokens, seqs, dp_size=norms.dp_size, loss_scale_factor=norms.loss_scale_factor)
        return original(loss_mat, loss_mask, mode, local, cu_seqlens=cu_seqlens)

    return agg


def test_catches_token_mean_normalised_per_micro_batch(ppo, monkeypatch):
    for module in (policy_loss, value_loss):
        monkeypatch.setattr(module, "agg_loss_with", _local_counts_agg(aggregate.agg_loss_with))
    failures = _failing(run_checks(ppo, "token-mean", update=False))
    assert "actor/loss [micro-batches=2]" in failures
    assert "actor/grad_norm [micro-batches=2]" in failures
    assert "critic/vf_loss [simulated dp=2]" in failures
    assert "[micro-batches=1]" not in failures  # one micro-batch holds the whole batch: local = global


def test_catches_attention_leaking_across_packed_sequences(ppo, monkeypatch):
    monkeypatch.setattr(attention_backends.AttentionCall, "bounds", lambda self: [0, int(self.cu_seqlens[-1])])
    failures = _failing(run_checks(ppo, update=False))
    assert "actor/grad_max_diff [micro-batches=1]" in failures
    assert "critic/values_mean [micro-batches=1]" in failures
    assert "on-policy: max |ratio - 1| = 0 [micro-batches=1]" in failures
    assert _one_each(ppo) not in failures  # one sequence per pack: nothing to leak into


@pytest.mark.slow  # one more check-metrics pass (about 15 s); the forward's equality is tests/unit/test_shared_prompts.py
def test_catches_responses_seeing_each_other_under_shared_prompts(ppo, monkeypatch):
    monkeypatch.setattr(shared_prompts, "_branch_mask", lambda branch: None)  # causal over the whole group
    cfg = OmegaConf.merge(ppo.cfg, {"trainer": {"share_prompts": True}})  # the shared layouts run with the setting
    failures = _failing(run_checks(dataclasses.replace(ppo, cfg=cfg), update=False))
    assert "actor/grad_max_diff [shared prompts, ranks=1]" in failures
    assert "critic/values_mean [shared prompts, ranks=1]" in failures
    assert "[micro-batches=1]" not in failures  # the unshared layouts are unaffected


def test_catches_a_missing_dp_size_factor(ppo, monkeypatch):
    original = aggregate.agg_loss_with

    def without_dp(loss_mat, loss_mask, mode, norms, *, cu_seqlens=None):
        no_dp = LossNormalizers(norms.global_num_tokens, norms.global_num_seqs, dp_size=1,
                                loss_scale_factor=norms.loss_scale_factor)
        return original(loss_mat, loss_mask, mode, no_dp, cu_seqlens=cu_seqlens)

    for module in (policy_loss, value_loss):
        monkeypatch.setattr(module, "agg_loss_with", without_dp)
    failures = _failing(run_checks(ppo, "seq-mean-token-sum"))
    assert "actor/grad_norm [simulated dp=2]" in failures
    assert "critic/loss [simulated dp=2]" in failures
    assert "[micro-batches=2]" not in failures  # dp size 1 layouts are unaffected


# ---- the battery: off-policy pass, experience checks, the trainer's own update code (issue 15) ------------------


def test_default_battery_reaches_the_paths_bugs_hide_in(ppo):
    report = run_checks(ppo)
    assert report.ok, "\n".join(report.failures)
    ref = report.reference.values
    # the off-policy pass binds both clip bounds, dual-clip, the k3 clamp range and the value clip
    assert 0.05 < ref["off-policy/actor/pg_clipfrac"] < 0.95
    assert ref["off-policy/actor/pg_clipfrac_lower"] > 0
    assert ref["off-policy/actor/probs_ratio_min"] < 0.8 and ref["off-policy/actor/probs_ratio_max"] > 1.28
    assert ref["off-policy/actor/kl"] > 1.0 and ref["off-policy/critic/vf_clipfrac"] > 0
    names = report.layouts
    longest = max(ppo.batch.full.lengths())
    assert f"packed budget={longest} (small)" in names  # many packs whatever the configured budget
    assert "simulated dp=2" in names and "ranks=1" in names
    assert any(n.startswith("off-policy: ") for n in names)
    assert {k.rule for k in report.checks if k.layout == "experience"} == {
        "experience: advantages = oracle (global whitening)", "experience: returns = oracle",
        "experience: advantages = oracle at gamma=0.9, lambda=0.8 on the real ranks",
        "experience: prompts and responses = the cut of the raw generation (EOS, rollout.max_new_tokens)",
        "experience: rewards = the weighted raw reward values",
        "experience: advantages = oracle on the perturbed batch (old, reference, values; KL-in-reward coef 0.1)",
        "experience: returns = oracle on the perturbed batch (old, reference, values; KL-in-reward coef 0.1)"}
    assert not ppo.trainer.policy_settings.use_reference  # the default config has no KL loss: the battery adds it


def _swap_settings(monkeypatch, session, changes):
    import dataclasses

    original = session.trainer.policy_settings.pg_loss_fn

    def buggy(logprobs, old_logprobs, advantages, valid, *, layout, settings):
        return original(logprobs, old_logprobs, advantages, valid, layout=layout,
                        settings=dataclasses.replace(settings, **changes(settings)))

    monkeypatch.setattr(session.trainer, "policy_settings",
                        dataclasses.replace(session.trainer.policy_settings, pg_loss_fn=buggy))


def test_catches_swapped_clip_bounds(ppo, monkeypatch):
    _swap_settings(monkeypatch, ppo, changes=lambda s: dict(clip_ratio_low=s.clip_ratio_high,
                                                           clip_ratio_high=s.clip_ratio_low))
    failures = _failing(run_checks(ppo, experience=False, update=False))
    assert "off-policy/actor/pg_loss [off-policy: ranks=1]" in failures
    assert "off-policy/actor/grad_max_diff [off-policy: " + _one_each(ppo)[1:] in failures
    assert "FAIL actor/" not in failures  # on-policy: ratio 1, the bounds never bind


def test_catches_dual_clip_off(ppo, monkeypatch):
    _swap_settings(monkeypatch, ppo, changes=lambda s: dict(clip_ratio_c=None))
    failures = _failing(run_checks(ppo, experience=False, update=False))
    assert "off-policy/actor/pg_clipfrac_lower [off-policy: " + _one_each(ppo)[1:] in failures
    assert "FAIL actor/" not in failures


def test_catches_a_wrong_k3_formula(ppo, monkeypatch):
    monkeypatch.setitem(policy_loss._KL, "k3", lambda d, kl_clamp: (torch.exp(d) - d - 1).clamp(-10, 10))  # sign of d
    failures = _failing(run_checks(ppo, experience=False, update=False))
    assert "off-policy/actor/kl [off-policy: packed budget=" in failures
    assert "off-policy/actor/kl_loss [off-policy: simulated dp=2]" in failures


def test_catches_temperature_dropped_in_the_chunked_log_probs(ppo, monkeypatch):
    from fsdptrain.rl import fused_loss

    original = fused_loss.chunked_logprobs_entropy
    monkeypatch.setattr(fused_loss, "chunked_logprobs_entropy",
                        lambda *a, temperature, **k: original(*a, temperature=1.0, **k))
    failures = _failing(run_checks(ppo, experience=False, update=False))
    assert "off-policy/actor/entropy [off-policy: packed budget=" in failures
    assert "FAIL actor/" not in failures  # the configured temperature is 1: the on-policy pass cannot see it


def _buggy_accumulate(scale):
    from fsdptrain.data.packing import pack_sequences
    from fsdptrain.distributed.collectives import plan_agreed
    from fsdptrain.metrics.typed import merge_all
    from fsdptrain.train import step

    def accumulate(model, batch, *, loss_fn, settings, norms, token_budget, device, plan=None, share_prompts=False):
        plan = plan if plan is not None else plan_agreed(batch.lengths(), token_budget)
        total, collected = 0.0, []
        for pack in plan.packs:
            packed = pack_sequences(batch.prompts, batch.responses, pack,
                                    response_masks=batch.response_masks()).to(device)
            loss, metrics = loss_fn(model, packed, [batch.targets[i] for i in pack], norms=norms, settings=settings)
            loss = loss * scale(plan, norms)
            loss.backward()
            total += float(loss.detach())
            collected.append(metrics)
        return step.Accumulated(merge_all(collected), total)

    return accumulate


def test_catches_micro_batch_losses_averaged(ppo, monkeypatch):
    from fsdptrain.train import step

    monkeypatch.setattr(step, "accumulate_gradients", _buggy_accumulate(lambda plan, norms: 1.0 / plan.num_packs))
    failures = _failing(run_checks(ppo, off_policy=False, experience=False, update=False))
    assert "critic/loss [micro-batches=2]" in failures  # the loss row: the scalar backward ran on
    assert f"critic/loss [packed budget={max(ppo.batch.full.lengths())} (small)]" in failures
    assert "[micro-batches=1]" not in failures and "[ranks=1]" not in failures  # one pack: nothing to average


def test_catches_the_dp_factor_applied_twice(ppo, monkeypatch):
    from fsdptrain.train import step

    monkeypatch.setattr(step, "accumulate_gradients", _buggy_accumulate(lambda plan, norms: norms.dp_size))
    failures = _failing(run_checks(ppo, off_policy=False, experience=False, update=False))
    assert "critic/loss [simulated dp=2]" in failures and "actor/grad_norm [simulated dp=2]" in failures
    assert "[micro-batches=2]" not in failures  # dp size 1 elsewhere on one rank


def test_catches_gae_skipping_the_last_token(ppo, monkeypatch):
    from fsdptrain.rl import estimator_registry

    original = estimator_registry.gae

    def skipping(rewards, values, mask, *, gamma, lam):
        last = mask.long().cumsum(1) == mask.long().sum(1, keepdim=True)
        return original(rewards, values, mask & ~last, gamma=gamma, lam=lam)  # the loop never visits the last

    monkeypatch.setattr(estimator_registry, "gae", skipping)
    report = run_checks(ppo, off_policy=False, update=False)
    failed = {k.rule for k in report.checks if not k.passed}
    # caught by the probe (gamma 0.9, lambda 0.8) and on the perturbed batch (values and KL penalty perturbed)
    perturbed = "on the perturbed batch (old, reference, values; KL-in-reward coef 0.1)"
    assert failed == {"experience: advantages = oracle at gamma=0.9, lambda=0.8 on the real ranks",
                      f"experience: advantages = oracle {perturbed}", f"experience: returns = oracle {perturbed}"}


def test_catches_gamma_and_lambda_swapped(ppo, monkeypatch):
    from fsdptrain.rl import estimator_registry

    original = estimator_registry.gae
    monkeypatch.setattr(estimator_registry, "gae",
                        lambda r, v, m, *, gamma, lam: original(r, v, m, gamma=lam, lam=gamma))
    report = run_checks(ppo, off_policy=False, update=False)
    failed = {k.rule for k in report.checks if not k.passed}
    assert failed == {"experience: advantages = oracle at gamma=0.9, lambda=0.8 on the real ranks"}


# ---- issue 27: the update over several mini-batches, the trainer's clip, the IS weights, a raising layout ----------


def _full_weights(session) -> dict:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in session.trainer.models.policy.named_parameters()}


def test_update_pass_runs_several_mini_batches_and_epochs_and_leaves_the_weights(ppo):
    before = _full_weights(ppo)
    report = run_checks(ppo, off_policy=False, experience=False)
    assert report.ok, "\n".join(report.failures)
    got = {c.metric: c for c in report.comparisons if c.layout == "mini-batches=2 x epochs=2"}
    ref = report.reference.values
    # 4 prompt groups in 2 mini-batches: each update sees half the batch's policy tokens, 8 sequences
    assert ref["update/loss/global_num_tokens"] == sum(sum(m) for m in ppo.batch.counted_masks()) / 2
    assert ref["update/loss/global_num_seqs"] == 8
    for name in ("update/actor/pg_loss", "update/actor/grad_norm", "update/critic/vf_loss", "update/critic/grad_norm",
                 "update/actor/probs_ratio_max", "update/loss/global_num_tokens"):
        assert got[name].passed, name
    assert ref["update/actor/probs_ratio_max"] > 1.01  # the second epoch ran on stepped weights
    assert all(torch.equal(before[k], v) for k, v in _full_weights(ppo).items())  # restored for the next check


def test_update_pass_scales_its_sgd_by_the_largest_mini_batch_not_a_first_one_of_pure_rounding(monkeypatch):
    """The continuous engine's batch for this row has a first mini-batch whose advantages are all 0 with the policy
    equal to the reference: its gradient is rounding (~1e-16). The SGD's learning rate was lr * sqrt(P) / that norm
    (~1e16): the second mini-batch's step overflowed the weights (update/actor/grad_norm 1e95, kl 5 against 0.04)."""
    from fsdptrain.check import update_pass

    norms = []
    step = update_pass._step_by_hand

    def recorded(model, optimizers, prefix, lr, max_norm, counts):
        norms.append(step(model, optimizers, prefix, lr, max_norm, counts))
        return norms[-1]

    monkeypatch.setattr(update_pass, "_step_by_hand", recorded)
    session = _session("algorithm=grpo", "algorithm.policy_loss=gmpo",
                       "algorithm.adv_estimator=reinforce_plus_plus_baseline", "loss.agg_mode=seq-mean-token-mean",
                       "algorithm.use_kl_loss=true", "algorithm.kl_estimator=k3+", "rollout.engine=continuous")
    report = run_checks(session, off_policy=False, experience=False)
    assert norms[0] < 1e-12 < 0.1 < norms[1]  # the batch still has the case: a first mini-batch of rounding
    assert report.ok, "\n".join(report.failures)
    assert max(norms) < 10  # no step blew the weights up


def test_catches_a_normaliser_over_the_whole_step_instead_of_the_mini_batch(ppo, monkeypatch):
    plant_normaliser_over_the_whole_step(monkeypatch.setattr)
    failures = _failing(run_checks(ppo, off_policy=False, experience=False))
    for name in ("loss/global_num_tokens", "actor/pg_loss", "critic/vf_loss"):
        assert f"update/{name} [mini-batches=2 x epochs=2]" in failures
    assert "[ranks=1]" not in failures  # one mini-batch: the normaliser is the mini-batch's


def test_a_raising_layout_is_a_fail_row_and_the_others_still_run(ppo, monkeypatch):
    from fsdptrain.check import run

    def broken(*args, **kwargs):
        raise TypeError("'NoneType' object is not subscriptable")

    monkeypatch.setattr(run, "padded_policy_loss", broken)
    report = run_checks(ppo, off_policy=False, experience=False, update=False)
    assert not report.ok
    assert len(report.failures) == 1, report.failures
    assert report.failures[0].startswith("FAIL (raised) [padded]: raised TypeError: 'NoneType' object is not "
                                         "subscriptable (at fsdptrain/check/layouts.py:")
    assert any(c.layout == "micro-batches=2" and c.passed for c in report.comparisons)


@pytest.mark.parametrize("overrides", [("algorithm.rollout_correction=tis",),
                                       ("algorithm.rollout_correction=mis",
                                        "algorithm.rollout_correction_level=sequence")], ids=["tis-token", "mis-seq"])
def test_rollout_correction_weights_and_metrics_from_their_definitions(overrides):
    # Before: TypeError in check/per_sequence.py, the prompt-only fixture had no weights.
    session = _session(*overrides)
    report = run_checks(session, off_policy=False, experience=False)
    assert report.ok, "\n".join(report.failures)
    ref = report.reference.values
    assert session.batch.planted_behaviour and session.batch.on_policy
    assert ref["experience/rollout_is_capped_frac"] > 0 and ref["experience/rollout_is_mean"] != 1.0
    names = {c.metric for c in report.comparisons if c.layout == "experience"}
    assert {"experience/rollout_is_mean", "experience/rollout_is_max", "experience/rollout_is_ratio_max",
            "experience/rollout_is_capped_frac", "experience/is_weights_max_diff", "experience/rollout_is_min",
            "experience/rollout_is_std", "experience/rollout_is_eff_sample_size"} <= names
    # the planted behaviour log-probs (old + U(-1, 1)) are off-policy: the diagnostics are logged and compared
    assert {"rollout_corr/kl_k1", "rollout_corr/kl_k3", "rollout_corr/log_ppl_diff",
            "rollout_corr/ratio_outside_frac", "rollout_corr/training_ppl", "rollout_corr/rollout_log_ppl",
            "rollout_corr/log_ppl_abs_diff", "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min",
            "rollout_corr/ppl_ratio", "rollout_corr/chi2_token", "rollout_corr/chi2_seq"} <= names
    assert 0 < ref["rollout_corr/ratio_outside_frac"] < 1 and ref["rollout_corr/kl_k3"] > 0


def test_catches_off_policy_diagnostics_over_one_sign_of_the_log_ratio(monkeypatch):
    """k3 written with d = old - behaviour (KL(old || behaviour) in place of KL(behaviour || old)) fails its row."""
    from fsdptrain.rl import rollout_correction

    original = rollout_correction.off_policy_diagnostics
    monkeypatch.setattr("fsdptrain.train.experience.off_policy_diagnostics",
                        lambda old, behaviour, mask, **kw: original(behaviour, old, mask, **kw))
    session = _session("algorithm.rollout_correction=tis")
    failures = _failing(run_checks(session, off_policy=False, experience=False, update=False))
    assert "rollout_corr/kl_k3 [experience]" in failures and "rollout_corr/kl_k1 [experience]" in failures


def test_catches_a_sequence_weight_from_the_mean_of_token_log_ratios(monkeypatch):
    plant_sequence_weight_from_mean_log_ratio(monkeypatch.setattr)
    session = _session("algorithm.rollout_correction=tis", "algorithm.rollout_correction_level=sequence")
    failures = _failing(run_checks(session, off_policy=False, experience=False, update=False))
    assert "experience/is_weights_max_diff [experience]" in failures
    assert "actor/loss [ranks=1]" in failures and "experience/rollout_is_ratio_max [experience]" in failures


def test_catches_inverted_importance_weights_in_the_off_policy_pass(ppo, monkeypatch):
    from fsdptrain.check import passes

    original = passes.rollout_correction_weights
    monkeypatch.setattr(passes, "rollout_correction_weights",
                        lambda old, behaviour, mask, **kw: original(behaviour, old, mask, **kw))
    failures = _failing(run_checks(ppo, experience=False, update=False))
    assert "off-policy/actor/loss [off-policy: ranks=1]" in failures
    assert "off-policy/critic/" not in failures


# ---- the per-token mask (multi-turn) and rejection sampling (issues 25 and 29) -----------------------------------


def test_catches_a_loss_on_tool_tokens(ppo, monkeypatch):
    plant_loss_on_tool_tokens(monkeypatch.setattr)
    failures = _failing(run_checks(ppo, "token-mean", off_policy=False, experience=False, update=False))
    assert "actor/probs_ratio_min [micro-batches=1]" in failures  # the configured budget's one pack
    assert "critic/loss [micro-batches=2]" in failures
    assert "[padded]" not in failures and "[per-sequence]" not in failures  # those read the mask themselves


def test_catches_tool_tokens_in_the_normaliser(ppo, monkeypatch):
    plant_tool_tokens_in_the_normaliser(monkeypatch.setattr)
    failures = _failing(run_checks(ppo, "token-mean", off_policy=False, experience=False, update=False))
    assert "actor/grad_norm [ranks=1]" in failures and "critic/vf_loss [ranks=1]" in failures
    assert "[micro-batches=2]" not in failures  # the layouts given the reference's counts are right


def test_rejection_sampling_passes_and_catches_rejected_tokens_in_the_normaliser(monkeypatch):
    overrides = ("algorithm.rollout_rejection=token",)
    clean = _session(*overrides)
    report = run_checks(clean, "token-mean", off_policy=False, experience=False, update=False)
    assert report.ok, "\n".join(report.failures)
    assert 0.1 < clean.batch.experience["experience/rollout_rs_rejected_token_frac"] < 0.9
    compared = {c.metric for c in report.comparisons if c.layout == "experience" and c.passed}
    assert {"experience/rollout_rs_rejected_token_frac", "experience/rollout_rs_rejected_seq_frac",
            "experience/rollout_rs_ratio_mean"} <= compared
    plant_rejected_tokens_in_the_normaliser(monkeypatch.setattr)
    planted = _session(*overrides)
    failures = _failing(run_checks(planted, "token-mean", off_policy=False, experience=False, update=False))
    assert "actor/pg_loss [ranks=1]" in failures


# ---- a layout that raises -----------------------------------------------------------------------------------------


def test_an_off_policy_layout_that_raised_stays_a_fail_row():
    outcome = run_module._prefixed(Outcome("padded", {}, covers=(), error="ValueError: boom"), keep_rollout=False)
    rows = compare(Outcome("reference", {"off-policy/actor/loss": 1.0}), outcome, rtol=0, atol=0, scales={})
    assert [(r.layout, r.passed, r.error) for r in rows] == [("off-policy: padded", False, "ValueError: boom")]


def test_a_layout_whose_backward_raised_midway_leaves_the_next_layout_clean(ppo):
    """The backward raises at the first decoder layer, after the root's fused loss has put gradients on its unsharded
    weights and before FSDP's end-of-backward callback: the next layout must still see exactly its own gradients."""
    part = run_module.parts_of(ppo, "token-mean")[0]
    ctx = run_module._context(ppo, ppo.batch, Counts.of(ppo.batch.counted_masks(), ppo.trainer.loss_scale_factor))
    packed = layouts.packed_with_budget()
    want = {name: grad.clone() for name, grad in packed(part, ctx).grads.items()}

    def raise_in_backward(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda _grad: (_ for _ in ()).throw(RuntimeError("planted: backward raised")))

    handle = decoder_layers(part.model)[0].register_forward_hook(raise_in_backward)
    try:
        outcome = run_module._layout_outcome("raises", packed, [part], ctx, {"actor/": want}, ppo)
    finally:
        handle.remove()
    assert "planted: backward raised" in outcome.error
    got = packed(part, ctx).grads
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


# ---- the decoders' cut (fsdptrain/check/raw_reference.py: recording_decoders, decoded_sequences) ---------------------

CUT = "experience: prompts and responses = the cut of the raw generation"


@pytest.fixture(scope="module")
def continuous():
    return _session("trainer.share_prompts=false", "rollout.engine=continuous")


def _cut_check(batch):
    (check,) = [c for c in batch.raw_checks if c.rule.startswith(CUT)]
    return check


def test_the_reference_cuts_the_continuous_engine_s_responses_itself(continuous):
    batch = continuous.batch
    assert not batch.raw_notes  # the reference cut them: not the sampler's own
    assert _cut_check(batch).passed
    ended = sum(not f.truncated for f in batch.facts)
    assert 0 < ended < len(batch.facts)  # both kinds of response, so each plant below has rows to change


@pytest.mark.parametrize("session", ["ppo", "continuous"])  # ppo: rollout.engine=generate
def test_the_eos_cut_off_the_response_fails_with_either_engine(request, monkeypatch, session):
    trainer = request.getfixturevalue(session).trainer
    plant_eos_cut_off_the_response(monkeypatch.setattr)
    check = _cut_check(make_batch(trainer, negative_values=False))
    assert not check.passed and check.value > 0, check.detail


def test_a_capped_response_reported_as_ended_fails(continuous, monkeypatch):
    plant_capped_response_not_truncated(monkeypatch.setattr)
    check = _cut_check(make_batch(continuous.trainer, negative_values=False))
    assert not check.passed and check.value > 0, check.detail
