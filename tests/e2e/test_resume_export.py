"""Checkpoints, exact resume, interruption, Hugging Face export and plot, through the real ``fsdptrain train`` CLI.

One 4-step reference run (checkpoints after steps 2 and 4, module-scoped) is what the other runs are measured
against: a run resumed from its step-2 checkpoint must reproduce its steps 3-4; a run killed inside the DCP writer
must leave its previous checkpoint usable; a SIGTERM'd run must stop cleanly and resume onto the same numbers; the
export must hold the final checkpoint's weights. Patches live in a ``sitecustomize.py`` the test writes onto
PYTHONPATH (no product switch). Metric comparisons skip the DIAGNOSTIC numbers (timings) by their recorded kind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_command, metric_kinds, run_cli, without_diagnostics

TINY = (
    "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
    "logging.progress=false", "trainer.lr_schedule=constant",
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- helpers --------------------------------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def assert_same_metrics(got: dict, want: dict, kinds: dict[str, str], *, tol: float = 1e-6) -> None:
    """Every key but the DIAGNOSTIC ones (by ``kinds``) present in both, and equal within ``tol`` (absolute, or
    relative for large values)."""
    got, want = without_diagnostics(got, kinds), without_diagnostics(want, kinds)
    keys = set(want)
    assert keys == set(got), sorted(keys ^ set(got))
    for key in sorted(keys):
        assert math.isclose(got[key], want[key], rel_tol=tol, abs_tol=tol), (got["step"], key, got[key], want[key])


def load_dcp(path: Path, tmp_path: Path) -> dict:
    """A DCP checkpoint folder as one plain dict {"models": {...}, "optimizers": {...}} (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)  # our own checkpoint, written by this test's run


def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flat_tensors(value, f"{prefix}/{key}"))
    return out


def write_patch(directory: Path, body: str) -> dict:
    """A sitecustomize.py in ``directory``, put first on PYTHONPATH: the env for a patched CLI run."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)


def wait_for_metrics(run_dir: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= 1:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before its first step: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no metrics line after {timeout} s: {proc.communicate()}")


def popen_cli(*args: str, cwd: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*cli_command(), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


# ---- the reference run ----------------------------------------------------------------------------------------------


GLOBAL_RNG_USER = """
    # Test patch: each step draws from torch's and python's global generators, as a user's reward function or
    # dropout would (fsdptrain's own sampling draws from a forked stream), so the checkpointed states are not the
    # fresh-seed ones and the RNG check of the resume test can fail.
    import random
    import torch
    import fsdptrain.train.rl as loop

    _run_step = loop.Trainer.run_step

    def run_step(self, step):
        torch.rand(3)
        random.random()
        return _run_step(self, step)

    loop.Trainer.run_step = run_step
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """4 uninterrupted steps, checkpoints after steps 2 and 4 (the final one), export; ``resume=auto`` on an empty
    run directory, which must start fresh."""
    cwd = tmp_path_factory.mktemp("reference")
    result = run_cli("train", *TINY, "trainer.steps=4", "checkpoint.every=2", "trainer.run_name=A",
                     "trainer.resume=auto", cwd=cwd, env=write_patch(cwd / "rng_user", GLOBAL_RNG_USER))
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = cwd / "runs" / "A"
    return {"cwd": cwd, "run_dir": run_dir, "metrics": read_metrics(run_dir), "result": result}


def test_resume_auto_without_checkpoint_starts_fresh_and_says_so(reference):
    out = reference["result"].stdout
    assert f"trainer.resume=auto: no complete checkpoint in {reference['run_dir']}; starting fresh" in out, out
    assert [m["step"] for m in reference["metrics"]] == [0, 1, 2, 3]
    assert sorted(p.name for p in (reference["run_dir"] / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004"]


# ---- exact resume -----------------------------------------------------------------------------------------------------


RNG_PROBE = """
    # Test patch: record this rank's RNG states right after the checkpoint is loaded.
    import os, random
    import torch
    import fsdptrain.distributed.sharded_checkpoint as checkpoint

    _load = checkpoint.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        extra = _load(*args, **kwargs)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, os.environ["RNG_PROBE_OUT"])
        return extra

    checkpoint.load_checkpoint = load_checkpoint
"""


def test_resume_reproduces_the_uninterrupted_run(reference, tmp_path):
    ref_run = reference["run_dir"]
    run_b = tmp_path / "runs" / "B"
    copy_checkpoint(ref_run, 2, run_b)
    env = write_patch(tmp_path / "patch", RNG_PROBE)
    env["RNG_PROBE_OUT"] = str(tmp_path / "rng_after_load.pt")
    result = run_cli("train", *TINY, "trainer.steps=4", "checkpoint.every=2", "trainer.run_name=B",
                     "trainer.resume=auto", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {tmp_path}/runs/B/checkpoints/step_00000002 after step 2" in result.stdout, result.stdout

    # Steps 3-4 (indices 2, 3) equal the uninterrupted run's, key by key.
    resumed = read_metrics(run_b)
    assert [m["step"] for m in resumed] == [2, 3]
    for got, want in zip(resumed, reference["metrics"][2:]):
        assert_same_metrics(got, want, metric_kinds(reference["run_dir"]))

    # RNG: right after the load, torch's and python's generators hold what run A saved after step 2, which differs
    # from a fresh manual_seed(trainer.seed=0) state (run A drew from it every step), so the check can fail.
    probe = torch.load(env["RNG_PROBE_OUT"], weights_only=False)
    saved = torch.load(ref_run / "checkpoints/step_00000002/rng_rank0.pt", weights_only=True)
    assert torch.equal(probe["torch"], saved["torch"])
    assert tuple(probe["python"][1]) == tuple(saved["python"][1])
    assert not torch.equal(saved["torch"], torch.manual_seed(0).get_state())

    # Optimiser state (moments and step counts), weights and data position after step 4 equal run A's.
    got = flat_tensors(load_dcp(run_b / "checkpoints/step_00000004", tmp_path))
    want = flat_tensors(load_dcp(ref_run / "checkpoints/step_00000004", tmp_path))
    before = flat_tensors(load_dcp(ref_run / "checkpoints/step_00000002", tmp_path))
    assert got.keys() == want.keys()
    assert any("exp_avg_sq" in k for k in got) and any(k.startswith("/optimizers/critic") for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)
    assert got["/optimizers/policy/state/model.norm.weight/step"].item() == 4.0
    assert before["/optimizers/policy/state/model.norm.weight/step"].item() == 2.0
    assert not torch.equal(got["/models/policy/model.norm.weight"], before["/models/policy/model.norm.weight"])
    state = torch.load(run_b / "checkpoints/step_00000004/trainer_state.pt", weights_only=True)
    assert state["extra"]["step"] == 4
    assert state["extra"]["data_position"] == 4 * 4  # 4 steps x rollout.prompts_per_step=4 prompt groups

    # The exports of both runs hold the same weights.
    from safetensors.torch import load_file

    for model in ("policy", "critic"):
        a = load_file(ref_run / "export" / model / "model.safetensors")
        b = load_file(run_b / "export" / model / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=f"{model}: {key}")


def test_resume_with_another_prompts_per_step_is_a_usage_error(reference, tmp_path):
    run_e = tmp_path / "runs" / "E"
    copy_checkpoint(reference["run_dir"], 2, run_e)
    result = run_cli("train", *TINY, "rollout.prompts_per_step=2", "trainer.steps=4", "trainer.run_name=E",
                     "trainer.resume=auto", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "rollout.prompts_per_step=2" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_one_rank_checkpoint_resumes_on_two_ranks_and_ctrl_c_stops_them(reference, tmp_path):
    """Resharding resume (1 -> 2 ranks) keeps training; a terminal's Ctrl-C (SIGINT to the launcher's process
    group: torch's launcher puts the ranks in sessions of their own) stops both ranks at a step boundary."""
    run_d = tmp_path / "runs" / "D"
    copy_checkpoint(reference["run_dir"], 2, run_d)
    proc = popen_cli("train", "--nproc", "2", *TINY, "trainer.steps=200", "trainer.run_name=D",
                     "trainer.resume=auto", cwd=tmp_path, start_new_session=True)
    try:
        wait_for_metrics(run_d, proc)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout + stderr
    assert f"resumed from {tmp_path}/runs/D/checkpoints/step_00000002 after step 2" in stdout, stdout
    assert "interrupted: saved checkpoint step_" in stdout, stdout
    metrics = read_metrics(run_d)
    stopped_at = metrics[-1]["step"] + 1
    assert [m["step"] for m in metrics] == list(range(2, stopped_at)) and stopped_at < 200
    # The same prompts as the 1-rank run's step 3 (data position), split over 2 ranks.
    assert metrics[0]["batch/num_prompt_tokens"] == reference["metrics"][2]["batch/num_prompt_tokens"]
    assert metrics[0]["batch/num_seqs"] == 8
    marker = json.loads((run_d / "checkpoints" / f"step_{stopped_at:08d}" / "complete.json").read_text())
    assert marker["world_size"] == 2 and marker["step"] == stopped_at


# ---- crash during save ------------------------------------------------------------------------------------------------


CRASH_IN_WRITER = """
    # Test patch: kill the process inside DCP's file writer during the second save, after its first item is on disk.
    import os
    import torch.distributed.checkpoint.filesystem as fs

    _write_item, _write_data = fs._write_item, fs._FileSystemWriter.write_data
    saves = 0

    def write_data(self, *args, **kwargs):
        global saves
        saves += 1
        return _write_data(self, *args, **kwargs)

    def write_item(transforms, stream, *args, **kwargs):
        result = _write_item(transforms, stream, *args, **kwargs)
        if saves == 2:
            stream.flush()
            os._exit(17)
        return result

    fs._FileSystemWriter.write_data, fs._write_item = write_data, write_item
"""


def test_crash_inside_the_writer_keeps_the_previous_checkpoint(reference, tmp_path):
    from fsdptrain.distributed.sharded_checkpoint import latest_checkpoint

    run_c = tmp_path / "runs" / "C"
    env = write_patch(tmp_path / "patch", CRASH_IN_WRITER)
    crashed = run_cli("train", *TINY, "trainer.steps=4", "checkpoint.every=1", "trainer.run_name=C",
                      cwd=tmp_path, env=env)
    assert crashed.returncode == 17, crashed.stdout + crashed.stderr
    partial = run_c / "checkpoints" / ".tmp_step_00000002"
    assert partial.is_dir() and not (partial / "complete.json").exists()
    assert any(p.stat().st_size > 0 for p in partial.glob("*.distcp"))  # died mid-save, not before it
    assert latest_checkpoint(run_c) == run_c / "checkpoints" / "step_00000001"

    resumed = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=1", "trainer.run_name=C",
                      "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {tmp_path}/runs/C/checkpoints/step_00000001 after step 1" in resumed.stdout, resumed.stdout
    assert not partial.exists()
    metrics = read_metrics(run_c)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # checkpoint.every does not change the numbers: the resumed steps are the reference run's.
    for got, want in zip(metrics, reference["metrics"]):
        assert_same_metrics(got, want, metric_kinds(reference["run_dir"]))


# ---- SIGTERM, one process -------------------------------------------------------------------------------------------


def test_sigterm_saves_exits_zero_and_resumes(reference, tmp_path):
    run_t = tmp_path / "runs" / "T"
    proc = popen_cli("train", *TINY, "trainer.steps=200", "trainer.run_name=T", cwd=tmp_path)
    try:
        wait_for_metrics(run_t, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "SIGTERM: stopping at the next step boundary" in stdout, stdout
    stopped_at = len(read_metrics(run_t))
    assert 1 <= stopped_at < 200
    name = f"step_{stopped_at:08d}"
    assert (f"interrupted: saved checkpoint {name} in {run_t}/checkpoints; resume with trainer.run_name=T "
            "trainer.resume=auto") in stdout, stdout
    assert (run_t / "checkpoints" / name / "complete.json").is_file()
    assert not (run_t / "export").exists()  # an interrupted run is not finished: no export

    result = run_cli("train", *TINY, f"trainer.steps={stopped_at + 1}", "trainer.run_name=T", "trainer.resume=auto",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {tmp_path}/runs/T/checkpoints/{name} after step {stopped_at}" in result.stdout, result.stdout
    metrics = read_metrics(run_t)
    assert [m["step"] for m in metrics] == list(range(stopped_at + 1))
    for got, want in zip(metrics, reference["metrics"]):  # the steps both runs took (at least 2 of them)
        assert_same_metrics(got, want, metric_kinds(reference["run_dir"]))
    assert (run_t / "export" / "policy" / "model.safetensors").is_file()


DOUBLE_CTRL_C = """
    # Test patch: two Ctrl-Cs during the second step, each seen by the handler before the next (a terminal user's
    # two presses; sent from outside they could merge into one pending signal or straddle the step boundary).
    import os, signal
    import fsdptrain.train.rl as trainer

    _run_step = trainer.Trainer.run_step

    def run_step(self, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return _run_step(self, step)

    trainer.Trainer.run_step = run_step
"""


def test_second_ctrl_c_stops_at_once_with_130(tmp_path):
    run_s = tmp_path / "runs" / "S"
    env = write_patch(tmp_path / "patch", DOUBLE_CTRL_C)
    result = run_cli("train", *TINY, "trainer.steps=4", "checkpoint.every=0", "trainer.run_name=S", cwd=tmp_path,
                     env=env)
    assert result.returncode == 130, result.stdout + result.stderr
    assert "SIGINT: stopping at the next step boundary" in result.stdout, result.stdout
    assert "interrupted: stopped at once, nothing saved" in result.stderr, result.stderr
    assert [m["step"] for m in read_metrics(run_s)] == [0]
    assert not (run_s / "checkpoints").exists()


# ---- export and plot --------------------------------------------------------------------------------------------------


def test_export_reproduces_the_final_checkpoint(reference, tmp_path):
    """The exported folders load with transformers (safetensors only, every weight accounted for) and give the same
    logits and values as fresh models holding the final checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    run_dir = reference["run_dir"]
    final = load_dcp(run_dir / "checkpoints" / "step_00000004", tmp_path)["models"]
    step2 = load_dcp(run_dir / "checkpoints" / "step_00000002", tmp_path)["models"]
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "export" / "policy")
    input_ids = tokenizer(["12 34", "7"], return_tensors="pt", padding=True)
    assert input_ids["input_ids"].numel() > 2
    for name, cls in (("policy", AutoModelForCausalLM), ("critic", AutoModelForTokenClassification)):
        folder = run_dir / "export" / name
        assert sorted(p.suffix for p in folder.iterdir() if p.suffix not in (".json",)) == [".safetensors"]
        exported, info = cls.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info
        fresh = cls.from_config(AutoConfig.from_pretrained(folder))
        fresh.load_state_dict(final[name], strict=True)
        fresh.eval()
        with torch.no_grad():
            got = exported(**input_ids).logits
            want = fresh(**input_ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # Not vacuous: the step-2 weights give other outputs.
        fresh.load_state_dict(step2[name], strict=True)
        with torch.no_grad():
            assert (fresh(**input_ids).logits - want).abs().max() > 1e-4
    assert exported.config.num_labels == 1


def test_plot_writes_a_png(reference, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "curves.png"
    result = run_cli("plot", str(reference["run_dir"]), "--out", str(out), cwd=reference["cwd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
