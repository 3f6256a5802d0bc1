"""``rollout.placement=separate`` end to end through the real CLI (docs/async.md): generator ranks and trainer ranks
in one gloo launch. k = 0 reproduces the colocated run bit for bit (metrics and exported weights); k = 1 trains off
the previous version, resumes exactly (the rollouts in flight come back from the checkpoint) and gives the same
metrics on 1 and 2 trainer ranks; a LoRA run sends the adapters alone; a generator that dies, hangs or raises ends
the run in one line naming it, exit 1; SIGTERM stops both sides."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.e2e.test_multi_turn import assert_close_rows, rows
from tests.e2e.test_resume_export import copy_checkpoint, popen_cli, wait_for_metrics, write_patch

TINY = ("rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
        "logging.progress=false", "trainer.lr_schedule=constant")
SEPARATE = ("rollout.placement=separate",)
ASYNC_ONLY = ("async/", "perf/")


def _plain(rows_: list[dict]) -> list[dict]:
    """Rows without the keys only a separate placement logs (its staleness and timings)."""
    return [{k: v for k, v in r.items() if not k.startswith("async/")} for r in rows_]


def _export(run_dir: Path) -> dict:
    return load_file(run_dir / "export" / "policy" / "model.safetensors")


def _train(tmp_path: Path, name: str, *args: str, nproc: int = 1, env: dict | None = None):
    result = run_cli("train", "--nproc", str(nproc), *TINY, *args, f"trainer.run_name={name}", cwd=tmp_path,
                     env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path / "runs" / name


def test_k0_equals_the_colocated_run_bit_for_bit(tmp_path):
    colocated = _train(tmp_path, "colocated", "trainer.steps=3")
    separate = _train(tmp_path, "separate", "trainer.steps=3", *SEPARATE, nproc=2)
    got, want = rows(separate), rows(colocated)
    assert [r["async/staleness"] for r in got] == [0, 0, 0]
    assert _plain(got) == want  # every number, exactly
    exported, reference = _export(separate), _export(colocated)
    assert exported.keys() == reference.keys()
    assert all(exported[k].equal(reference[k]) for k in reference)


def test_k1_trains_resumes_exactly_and_equals_on_two_trainer_ranks(tmp_path):
    args = ("trainer.steps=4", "checkpoint.every=2", *SEPARATE, "rollout.max_staleness=1")
    one = rows(_train(tmp_path, "one", *args, nproc=2))
    assert [r["async/staleness"] for r in one] == [0, 1, 1, 1]
    # off-policy from step 1: the behaviour log-probs are the generating version's, so they differ from the old ones
    assert one[0]["rollout_corr/kl_k3"] < 1e-6 < one[2]["rollout_corr/kl_k3"]
    copy_checkpoint(tmp_path / "runs" / "one", 2, tmp_path / "runs" / "resumed")
    resumed = run_cli("train", "--nproc", "2", *TINY, *args, "trainer.run_name=resumed", "trainer.resume=auto",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_close_rows(rows(tmp_path / "runs" / "resumed"), one[2:], tol=1e-6)
    two = rows(_train(tmp_path, "two", *args, nproc=3))  # two trainer ranks, one generator
    assert_close_rows(two, one, tol=1e-5)


def test_resuming_past_the_end_with_staleness_is_refused_in_one_line(tmp_path):
    args = ("trainer.steps=2", "checkpoint.every=2", *SEPARATE, "rollout.max_staleness=1")
    _train(tmp_path, "short", *args, nproc=2)
    longer = run_cli("train", "--nproc", "2", *TINY, *args[1:], "trainer.steps=4", "trainer.run_name=short",
                     "trainer.resume=auto", cwd=tmp_path)
    assert longer.returncode == 2, longer.stdout + longer.stderr
    assert "holds no rollouts of steps 2..2" in longer.stderr and "Traceback" not in longer.stderr


def _adapter_bytes(config: dict, r: int) -> int:
    """LoRA's A (r x in) and B (out x r) for each linear layer of a Llama block, fp32: by hand from the config."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]  # q k v o gate up down
    return 4 * config["num_hidden_layers"] * sum(r * (fan_in + fan_out) for fan_in, fan_out in shapes)


def test_a_lora_run_broadcasts_the_adapters_only(tmp_path):
    full = _train(tmp_path, "full", "trainer.steps=2", *SEPARATE, nproc=2)
    lora = _train(tmp_path, "lora", "trainer.steps=3", *SEPARATE, "model.lora.r=2", nproc=2)
    config = json.loads((lora / "export" / "policy" / "config.json").read_text())
    # after step 0, version 1: every trainable weight, fp32 (the export holds each once)
    assert rows(full)[0]["async/broadcast_bytes"] == 4 * sum(t.numel() for t in _export(full).values())
    assert [r["async/broadcast_bytes"] for r in rows(lora)][:2] == [_adapter_bytes(config, 2)] * 2


# ---- failure --------------------------------------------------------------------------------------------------------

GENERATOR_FAULT = """
    # Test patch: the generator rank (the last one) fails at step 1, as FAULT says.
    import os, signal, time
    import fsdptrain.rollout.single_turn as single_turn

    _sample = single_turn.SingleTurnSampler.sample

    def sample(self, decoder, groups, *, step, **kwargs):
        last = int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
        if last and step == 1 and kwargs.get("mode") == "train":
            fault = os.environ["FAULT"]
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang":
                time.sleep(3600)
            raise ValueError("planted failure")
        return _sample(self, decoder, groups, step=step, **kwargs)

    single_turn.SingleTurnSampler.sample = sample
"""


@pytest.mark.parametrize("fault, message", [
    ("kill", "error: generator rank 1 is gone: its process ended"),
    ("hang", "error: generator rank 1 sent no rollouts for 4 s (rollout.generator_timeout_s)"),
    ("raise", "error: generator rank 1 failed: ValueError: planted failure"),
])
def test_a_failing_generator_ends_the_run_in_one_line(tmp_path, fault, message):
    env = {**write_patch(tmp_path / "patch", GENERATOR_FAULT), "FAULT": fault}
    began = time.monotonic()
    result = run_cli("train", "--nproc", "2", *TINY, *SEPARATE, "trainer.steps=3", "checkpoint.every=1",
                     "rollout.generator_timeout_s=4", "trainer.run_name=failing", cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - began < 90
    checkpoint = tmp_path / "runs" / "failing" / "checkpoints" / "step_00000001"
    assert (checkpoint / ".metadata").exists() or any(checkpoint.iterdir())  # step 1's checkpoint is intact


def test_sigterm_stops_both_sides_after_a_checkpoint(tmp_path):
    proc = popen_cli("train", "--nproc", "2", *TINY, *SEPARATE, "rollout.max_staleness=1", "trainer.steps=200",
                     "checkpoint.every=50", "trainer.run_name=stopped", cwd=tmp_path)
    wait_for_metrics(tmp_path / "runs" / "stopped", proc)
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 60 s after SIGTERM: {proc.communicate()}")
    assert proc.returncode == 0, stdout + stderr
    saved = sorted(p.name for p in (tmp_path / "runs" / "stopped" / "checkpoints").iterdir())
    assert saved and saved[-1].startswith("step_"), saved
    assert "Traceback" not in stderr
