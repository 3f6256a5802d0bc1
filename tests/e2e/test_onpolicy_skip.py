"""Skipping the old log-prob pass (and the critic's old-value pass) when the update is strictly on-policy
(``algorithm.recompute_old_logprobs=auto``, docs/performance.md) gives the same run as recomputing them (``always``):
every logged metric, and the exported weights after 3 steps (so every step's gradients were the same too).

Measured: bit-identical (tolerance 0), since the experience pass and the first update forward run the same packed
forward on the same weights; the test asserts exact equality so that any drift shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import metric_kinds, without_diagnostics

TINY = ("rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
        "logging.progress=false", "trainer.steps=3")
CONFIGS = {
    # GAE: the old log-prob pass is skipped; the critic's values are needed for the advantages and still computed.
    "ppo": (),
    # GRPO with a critic and a KL loss: both the old log-prob and the old-value passes are skipped.
    "grpo_critic_kl": ("algorithm=grpo", "algorithm.use_critic=true", "algorithm.use_kl_loss=true"),
}


GAP = {"rollout/logprob_diff/mean", "rollout/logprob_diff/max"}
"""Logged by the old log-prob pass, or, where it is skipped, by the first update forward (docs/rollout.md)."""


def _run(cli, tmp_path: Path, name: str, *overrides: str) -> tuple[list[dict], Path]:
    run_dir = tmp_path / name
    proc = cli("train", *TINY, *overrides, f"trainer.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return lines, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_skip_equals_recompute(cli, tmp_path, config):
    from safetensors.torch import load_file

    skipped, dir_a = _run(cli, tmp_path, "auto", *CONFIGS[config], "algorithm.recompute_old_logprobs=auto")
    recomputed, dir_b = _run(cli, tmp_path, "always", *CONFIGS[config], "algorithm.recompute_old_logprobs=always")
    # The skip took place: fewer model FLOPs per step for the same tokens.
    assert skipped[0]["perf/tflops_per_rank"] * skipped[0]["perf/step_s"] < (
        recomputed[0]["perf/tflops_per_rank"] * recomputed[0]["perf/step_s"])
    kinds_a, kinds_b = metric_kinds(dir_a), metric_kinds(dir_b)
    for got, want in zip(skipped, recomputed, strict=True):
        assert GAP <= want.keys() and GAP <= got.keys(), (sorted(want), sorted(got))
        # the gap is pooled over the packed row here and over the padded rollouts there: the sum's order differs
        assert {k: got[k] for k in GAP} == pytest.approx({k: want[k] for k in GAP}, rel=1e-12, abs=0)
        assert ({k: v for k, v in without_diagnostics(got, kinds_a).items() if k not in GAP}
                == {k: v for k, v in without_diagnostics(want, kinds_b).items() if k not in GAP})
    assert skipped[0]["actor/on_policy_max_ratio_dev"] == 0.0
    for model in [p.name for p in (dir_b / "export").iterdir() if p.is_dir()]:
        a = load_file(dir_a / "export" / model / "model.safetensors")
        b = load_file(dir_b / "export" / model / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].equal(b[key]), (model, key)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_the_skipped_pass_still_logs_the_generation_gap(cli, tmp_path, nproc):
    # The default run skipped the old log-prob pass and with it rollout/logprob_diff/*: the train/inference gap was
    # never shown. The first update forward now logs it: the value the pass logs when forced to run, on the same run.
    steps = ("--nproc", nproc, "trainer.steps=1")
    skipped, dir_a = _run(cli, tmp_path, "auto", *steps, "algorithm.recompute_old_logprobs=auto")
    recomputed, dir_b = _run(cli, tmp_path, "always", *steps, "algorithm.recompute_old_logprobs=always")
    assert skipped[0]["perf/tflops_per_rank"] * skipped[0]["perf/step_s"] < (
        recomputed[0]["perf/tflops_per_rank"] * recomputed[0]["perf/step_s"])  # the pass was skipped
    got, want = ({k: row[0].get(k) for k in GAP} for row in (skipped, recomputed))
    assert got == pytest.approx(want, rel=1e-12, abs=0), (got, want)
    assert 0 < got["rollout/logprob_diff/mean"] <= got["rollout/logprob_diff/max"] < 1e-5  # fp32: rounding only
    assert metric_kinds(dir_a)["rollout/logprob_diff/mean"] == "mean"
    assert metric_kinds(dir_a)["rollout/logprob_diff/max"] == "max"


@pytest.mark.parametrize("level", ["token", pytest.param("sequence", marks=pytest.mark.slow)])
def test_rollout_correction_on_policy_keeps_the_pass_and_weights_are_exactly_1(cli, tmp_path, level):
    # The skipped pass left the importance weights None: the first step raised AttributeError in the packed loss.
    # On-policy the behaviour log-probs are the old ones, so every weight is exp(0) = 1 exactly.
    lines, _ = _run(cli, tmp_path, "tis", "trainer.steps=1", "algorithm.rollout_correction=tis",
                    f"algorithm.rollout_correction_level={level}")
    assert lines[0]["experience/rollout_is_mean"] == 1.0
    assert lines[0]["experience/rollout_is_ratio_max"] == 1.0
    assert lines[0]["experience/rollout_is_capped_frac"] == 0.0
