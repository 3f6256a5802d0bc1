"""``fsdptrain train --nproc 2 parallel.ep=2`` on a user's tiny Qwen3-MoE folder (4 experts, top-2) as a user runs it:
the same metrics as ``parallel.ep=1`` on the same 2 ranks, an exact resume from its own checkpoint, and an export
transformers loads with all 4 experts, equal to ep=1's. The numbers of one update are proven in
tests/dist/test_expert_parallel.py; this is the run around them (generation with the experts gathered, the
experience pass, DCP, export)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import metric_kinds, run_cli
from tests.e2e.test_resume_export import assert_same_metrics, read_metrics
from tests.helpers.tiny_moe import save_tiny_moe

RUN = ("train", "--nproc", "2", "algorithm=grpo", "rollout.prompts_per_step=4", "rollout.n=2",
       "rollout.max_new_tokens=6", "trainer.eval_every=0", "logging.progress=false", "trainer.lr_schedule=constant",
       "trainer.steps=2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ep=1 for 2 steps; ep=2 for 2 steps with a checkpoint after each; ep=2 resumed from the first checkpoint."""
    cwd = tmp_path_factory.mktemp("ep")
    model = ("model=local", f"model.path={save_tiny_moe(cwd / 'moe', norm_topk_prob=True)}")
    one = run_cli(*RUN, *model, "parallel.ep=1", "trainer.run_name=one", cwd=cwd)
    assert one.returncode == 0, one.stdout + one.stderr
    two = run_cli(*RUN, *model, "parallel.ep=2", "checkpoint.every=1", "trainer.run_name=two", cwd=cwd)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "mesh (2,), experts over ep=2 (mesh (dp_shard_mod_ep, ep) = (1, 2))" in two.stdout
    shutil.copytree(cwd / "runs/two/checkpoints/step_00000001", cwd / "runs/resumed/checkpoints/step_00000001")
    resumed = run_cli(*RUN, *model, "parallel.ep=2", "checkpoint.every=1", "trainer.run_name=resumed",
                      "trainer.resume=auto", cwd=cwd)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    return cwd / "runs"


def test_ep2_logs_the_metrics_of_ep1(runs):
    one, two = read_metrics(runs / "one"), read_metrics(runs / "two")
    assert [m["step"] for m in two] == [0, 1]
    for got, want in zip(two, one):
        assert_same_metrics(got, want, metric_kinds(runs / "one"), tol=1e-6)


def test_ep2_resumes_exactly(runs):
    resumed, two = read_metrics(runs / "resumed"), read_metrics(runs / "two")
    assert [m["step"] for m in resumed] == [1]
    assert_same_metrics(resumed[0], two[1], metric_kinds(runs / "two"), tol=0.0)


def test_ep2_exports_every_expert_as_transformers_reads_it(runs):
    from transformers import AutoModelForCausalLM

    one = AutoModelForCausalLM.from_pretrained(runs / "one/export/policy").state_dict()
    two = AutoModelForCausalLM.from_pretrained(runs / "two/export/policy").state_dict()
    assert one.keys() == two.keys()
    assert two["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight, rtol=0, atol=1e-6, msg=name)


def test_ep_on_a_dense_model_is_one_line_and_exit_2(cli):
    result = cli("train", "--nproc", "2", "parallel.ep=2", "trainer.steps=1", "logging.progress=false")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: parallel.ep=2 needs a mixture-of-experts model; LlamaForCausalLM has no sparse block: set "
        "parallel.ep=1 (docs/moe.md)")
    assert "Traceback" not in result.stderr
