"""A critic started from a causal LM's checkpoint gets a value head the checkpoint lacks, drawn on purpose: the run
says so in one line of its own, and transformers' load report (``score.weight | MISSING ... Consider training on your
downstream task``), which reads as a fault, does not reach the user."""

from __future__ import annotations

from tests.helpers.teacher_folders import save_teacher


def test_a_new_value_head_is_reported_by_fsdptrain_not_by_transformers(cli, tmp_path):
    folder = save_teacher(tmp_path / "lm")
    proc = cli("train", "model=local", f"model.path={folder}", "trainer.steps=1", "rollout.prompts_per_step=2",
               "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0", "logging.progress=false",
               f"trainer.run_dir={tmp_path / 'run'}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "LOAD REPORT" not in out and "MISSING" not in out and "downstream task" not in out, out
    line = f"critic: value head score (64 -> 1) drawn at random from seed 1, on purpose (a causal LM has none); " \
           f"backbone loaded from {folder}"
    assert out.count(line) == 1, out
