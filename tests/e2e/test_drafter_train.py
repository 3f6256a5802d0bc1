"""The co-trained drafter through the real ``fsdptrain train`` CLI: it trains, it resumes onto the same numbers, its
export reloads with the checkpoint's weights and logits, it leaves the policy's run untouched, bad settings exit 2.

One 3-step reference run with the drafter (checkpoints after steps 2 and 3, float32 export) is module-scoped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fsdptrain.model.drafter_export import ARCHITECTURE, load_drafter
from tests.conftest import metric_kinds, run_cli, without_diagnostics
from tests.e2e.test_resume_export import copy_checkpoint, load_dcp, read_metrics

TINY = (
    "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
    "logging.progress=false", "trainer.steps=3",
    # the packed row the drafter reads is the unshared one (share_prompts=auto resolves to false with the drafter,
    # true without): pinned, so that the run without the drafter packs as the run with it does
    "trainer.share_prompts=false",
)
DRAFTER = ("drafter.enabled=true", "drafter.draft_vocab_size=16", "drafter.lr=3e-3", "drafter.export_dtype=float32")
DRAFTER_METRICS = ("drafter/loss", "drafter/top1_agreement", "drafter/accept_prob", "drafter/expected_accept_len@3",
                   "drafter/grad_norm")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("drafter_ref")
    result = run_cli("train", *TINY, *DRAFTER, "checkpoint.every=2", f"trainer.run_dir={work / 'run'}", cwd=work)
    assert result.returncode == 0, result.stderr[-4000:]
    return work / "run"


def test_drafter_trains_and_logs_its_metrics(reference_run):
    rows = read_metrics(reference_run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for key in DRAFTER_METRICS:
            assert math.isfinite(row[key]), (row["step"], key)
        assert 0.0 <= row["drafter/accept_prob"] <= 1.0
        assert 0.0 <= row["drafter/expected_accept_len@3"] <= 3.0  # accepted draft tokens of 3 (no bonus)
        assert row["drafter/global_num_tokens"] > 0
    assert rows[1]["drafter/loss"] != rows[0]["drafter/loss"]  # the drafter moved (and so did its teacher)


@pytest.mark.slow  # CI budget: DCP resume is exact in tests/dist/test_checkpoint.py and tests/e2e/test_resume_export.py
def test_resume_reproduces_the_drafter_metrics_exactly(reference_run, tmp_path):
    run = tmp_path / "run"
    first = run_cli("train", *TINY, *DRAFTER, "checkpoint.every=2", "trainer.steps=2", f"trainer.run_dir={run}",
                    cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = run_cli("train", *TINY, *DRAFTER, "checkpoint.every=2", "trainer.resume=auto", f"trainer.run_dir={run}",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    want, got = read_metrics(reference_run)[2], read_metrics(run)[2]
    for key in [k for k in want if k.startswith("drafter/")]:
        assert got[key] == want[key], (key, got[key], want[key])


def test_export_reloads_with_the_checkpoint_weights_and_logits(reference_run, tmp_path):
    folder = reference_run / "export" / "drafter"
    fields = json.loads((folder / "config.json").read_text())
    assert fields["architectures"] == [ARCHITECTURE] and fields["draft_vocab_size"] == 16
    exported = load_drafter(folder)
    saved = load_dcp(reference_run / "checkpoints" / "step_00000003", tmp_path)["models"]["drafter"]
    state = exported.state_dict()
    assert set(saved) == set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    # the logits of the reloaded head equal those of the checkpoint's weights on the same inputs
    gen = torch.Generator().manual_seed(0)
    hidden = fields["target_hidden_size"]
    features = torch.randn(5, 3 * hidden, generator=gen)
    embeds = torch.randn(5, hidden, generator=gen)
    positions = torch.arange(5)[None]
    with exported.attention("sdpa"):
        got = exported.compute_logits(exported(features, embeds, position_ids=positions))
    twin = load_drafter(folder)
    twin.load_state_dict(saved, strict=True)
    with twin.attention("sdpa"):
        want = twin.compute_logits(twin(features, embeds, position_ids=positions))
    assert torch.equal(got, want)
    assert got.shape == (5, 16)


@pytest.mark.slow
def test_drafter_on_leaves_the_policy_run_unchanged(reference_run, tmp_path):
    off = run_cli("train", *TINY, "checkpoint.every=2", f"trainer.run_dir={tmp_path / 'off'}", cwd=tmp_path)
    assert off.returncode == 0, off.stderr[-4000:]
    kinds = metric_kinds(tmp_path / "off")
    for on_row, off_row in zip(read_metrics(reference_run), read_metrics(tmp_path / "off"), strict=True):
        for key in without_diagnostics(off_row, kinds):
            assert on_row[key] == off_row[key], (on_row["step"], key)


@pytest.mark.parametrize("override, needle", [
    ("drafter.draft_vocab_size=100", "drafter.draft_vocab_size=100"),
    ("drafter.feature_layers=[0,1]", "drafter.feature_layers"),
    ("drafter.feature_layers=[0,1,5]", "drafter.feature_layers"),
    ("drafter.on=prompt", "drafter.on"),
])
def test_bad_drafter_settings_exit_2_with_one_line(cli, override, needle):
    result = cli("train", *TINY, "drafter.enabled=true", override)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_resume_while_the_vocabulary_is_counted(tmp_path):
    """vocab_from_steps=2 and a resume after step 1: the counts so far come back from the checkpoint, so the
    vocabulary, and every later number, are those of the uninterrupted run."""
    args = (*TINY, *DRAFTER, "drafter.vocab_from_steps=2", "drafter.draft_vocab_size=10", "checkpoint.every=1",
            "checkpoint.keep=5")
    whole = run_cli("train", *args, f"trainer.run_dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-4000:]
    copy_checkpoint(tmp_path / "whole", 1, tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.jsonl").write_text((tmp_path / "whole" / "metrics.jsonl").read_text())
    resumed = run_cli("train", *args, "trainer.resume=auto", f"trainer.run_dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "after step 1" in resumed.stdout + resumed.stderr
    want, got = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert "drafter/accept_prob" not in want[0] and "drafter/accept_prob" in want[1]
    for w, g in zip(want[1:], got[1:], strict=True):
        for key in without_diagnostics(w, metric_kinds(tmp_path / "whole")):
            assert g[key] == w[key], (w["step"], key)


@pytest.mark.slow  # 4 x 20 default steps; the drafter's loss, gradients and update are proven exact in tests/dist/test_drafter_step.py
def test_acceptance_rises_over_a_20_step_default_run(tmp_path):
    """The bundled default with the default drafter.lr (max(1e-4, trainer.lr) = 3e-3): over its first 20 steps the
    drafter keeps up with the sharpening policy, steps 15-19 accept more than steps 0-4 in the mean over seeds 0-3
    (measured on the continuous engine, 2026-12-07: 0.898 -> 0.912; per seed 0.902 -> 0.894, 0.897 -> 0.957,
    0.889 -> 0.937, 0.904 -> 0.858, so one seed decides nothing; with rollout.engine=generate seed 0 went 0.901 ->
    0.930; with drafter.lr=1e-4 it falls to about 0.76 by step 10). docs/drafter.md has the 100-step numbers."""
    firsts, lasts = [], []
    for seed in range(4):
        run = tmp_path / f"run{seed}"
        result = run_cli("train", "drafter.enabled=true", "trainer.steps=20", "trainer.eval_every=0",
                         f"trainer.seed={seed}", "logging.progress=false", "checkpoint.every=0",
                         f"trainer.run_dir={run}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        accept = [row["drafter/accept_prob"] for row in read_metrics(run)]
        assert len(accept) == 20
        firsts.append(sum(accept[:5]) / 5)
        lasts.append(sum(accept[-5:]) / 5)
    assert sum(lasts) / 4 > sum(firsts) / 4 + 0.005, (firsts, lasts)


@pytest.mark.slow  # CI budget: exact resume of a drafter run stays in CI (test_resume_reproduces_the_drafter_metrics_exactly)
def test_refresh_passes_resume_exactly_and_leave_the_policy_run(reference_run, tmp_path):
    """drafter.refresh_passes=2: the drafter moves differently (two more steps per mini-batch, taught by the updated
    policy), the policy's run is the reference run's number for number, and a resume after step 2 reproduces step
    3's drafter metrics exactly (the refresh steps live in the drafter's weights and AdamW state)."""
    args = (*TINY, *DRAFTER, "drafter.refresh_passes=2", "checkpoint.every=2")
    whole = run_cli("train", *args, f"trainer.run_dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-4000:]
    first = run_cli("train", *args, "trainer.steps=2", f"trainer.run_dir={tmp_path / 'split'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = run_cli("train", *args, "trainer.resume=auto", f"trainer.run_dir={tmp_path / 'split'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    want, got = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    for key in [k for k in want[2] if k.startswith("drafter/")]:
        assert got[2][key] == want[2][key], (key, got[2][key], want[2][key])
    reference = read_metrics(reference_run)
    assert want[0]["drafter/loss"] == reference[0]["drafter/loss"]  # step 0 scores the same new drafter
    assert want[1]["drafter/loss"] != reference[1]["drafter/loss"]  # then the refresh steps have moved it
    for row, ref in zip(want, reference, strict=True):
        for key in without_diagnostics(ref, metric_kinds(reference_run)):
            if not key.startswith("drafter/"):
                assert row[key] == ref[key], (row["step"], key)
