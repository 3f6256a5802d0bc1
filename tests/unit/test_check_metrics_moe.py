"""check-metrics on a mixture-of-experts policy (a tiny Qwen3-MoE folder), in one process: the load-balancing loss
(``actor/moe/aux_loss``), its gradient and the expert-load metrics agree in every layout, and each planted bug is
caught: each forward's own aux loss (the per-micro-batch value) and an aux loss that counts padding."""

from __future__ import annotations

import pytest
import torch

from fsdptrain.check.batch import build_session
from fsdptrain.check.run import run_checks
from fsdptrain.config.compose import compose_config
from fsdptrain.distributed import world
from tests.helpers.planted_bugs import plant_moe_aux_loss_counts_padding, plant_moe_aux_loss_per_micro_batch
from tests.helpers.tiny_moe import write_tiny_moe

LAYOUTS_ONLY = dict(off_policy=False, experience=False, update=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    torch.set_num_threads(1)
    folder = write_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")
    cfg = compose_config(["model=local", f"model.path={folder}", "algorithm=grpo", "rollout.prompts_per_step=2",
                          "rollout.n=2", "rollout.max_new_tokens=6", "model.moe.aux_loss_coef=0.5"])
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    return build_session(cfg, info, mesh)


def _failures(report) -> str:
    assert not report.ok, "the planted bug was not caught"
    return "\n".join(report.failures)


def test_the_aux_loss_its_gradient_and_the_load_agree_in_every_layout(moe):
    report = run_checks(moe, "token-mean", **LAYOUTS_ONLY)
    assert report.ok, "\n".join(report.failures)
    compared = {(c.metric, c.layout) for c in report.comparisons if c.passed}
    for layout in ("padded", "micro-batches=2", "simulated dp=2", "ranks=1", "shared prompts, ranks=1"):
        assert ("actor/moe/aux_loss", layout) in compared
        assert ("actor/moe/layer_1/load_cv", layout) in compared
        assert ("actor/grad_max_diff", layout) in compared


def test_catches_the_per_micro_batch_aux_loss(moe, monkeypatch):
    plant_moe_aux_loss_per_micro_batch(monkeypatch.setattr)
    failures = _failures(run_checks(moe, "token-mean", **LAYOUTS_ONLY))
    assert "actor/moe/aux_loss [micro-batches=2]" in failures


def test_catches_an_aux_loss_that_counts_padding(moe, monkeypatch):
    plant_moe_aux_loss_counts_padding(monkeypatch.setattr)
    failures = _failures(run_checks(moe, "token-mean", **LAYOUTS_ONLY))
    assert "actor/moe/aux_loss [padded]" in failures
