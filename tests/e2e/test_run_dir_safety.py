"""Nothing lost, nothing silent: kills, a full disk, damaged files and restarts, through the real CLI.

One real 2-step run (checkpoints after steps 1 and 2) is copied for each test that needs a used run directory.
Patches live in a ``sitecustomize.py`` put first on PYTHONPATH (no product switch). Metric comparisons skip the DIAGNOSTIC numbers (timings) by their recorded kind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import cli_command, metric_kinds, run_cli, without_diagnostics

TINY = ("rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
        "logging.progress=false")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def compared(rows: list[dict], run_dir: Path) -> list[dict]:
    kinds = metric_kinds(run_dir)
    return [without_diagnostics(row, kinds) for row in rows]


def patched_env(directory: Path, body: str) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def used(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("used")
    result = run_cli("train", *TINY, "trainer.steps=2", "checkpoint.every=1", "trainer.run_name=u", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd / "runs" / "u"


@pytest.fixture
def run_copy(used, tmp_path) -> Path:
    target = tmp_path / "runs" / "u"
    shutil.copytree(used, target)
    (target / ".lock").unlink(missing_ok=True)
    return target


TRIM_KILL_PATCH = """
    import builtins, io, os, signal
    _open = io.open
    def open(file, mode="r", *args, **kwargs):
        handle = _open(file, mode, *args, **kwargs)
        if "w" in mode and os.path.basename(str(file)).startswith("metrics.jsonl"):
            os.kill(os.getpid(), signal.SIGKILL)  # killed right after opening metrics.jsonl (or its temp) to rewrite
        return handle
    io.open = builtins.open = open
"""


def test_a_kill_during_the_metrics_trim_leaves_the_old_file(run_copy, tmp_path):
    before = (run_copy / "metrics.jsonl").read_bytes()
    env = patched_env(tmp_path / "patch", TRIM_KILL_PATCH)
    result = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=1", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path, env=env)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert (run_copy / "metrics.jsonl").read_bytes() == before


ENOSPC_PATCH = """
    import errno, importlib.abc, importlib.util, sys
    TARGET = "torch.distributed.checkpoint.filesystem"
    def _patch(module):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device")
        module.FileSystemWriter.write_data = write_data
    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module
            def exec_and_patch(module):
                run(module)
                _patch(module)
            spec.loader.exec_module = exec_and_patch
            return spec
    sys.meta_path.insert(0, _Finder())
"""


def test_disk_full_during_a_save_is_one_line_exit_1_and_keeps_the_checkpoints(run_copy, tmp_path):
    checkpoints = tree(run_copy / "checkpoints")
    env = patched_env(tmp_path / "patch", ENOSPC_PATCH)
    result = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=1", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path, env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(errors) == 1 and "no space left" in errors[0], result.stderr
    now = tree(run_copy / "checkpoints")
    assert {k: v for k, v in now.items() if not k.startswith(".tmp_")} == checkpoints


def test_resume_skips_a_damaged_newest_checkpoint_and_a_partial_metrics_line(used, run_copy, tmp_path):
    newest = run_copy / "checkpoints" / "step_00000002"
    data = sorted(newest.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    with (run_copy / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2, "reward/me')
    result = run_cli("train", *TINY, "trainer.steps=2", "checkpoint.every=1", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skipping damaged checkpoint {newest}: {data.name} is truncated" in result.stderr
    assert "dropped a partial last line" in result.stderr
    assert "resumed from" in result.stdout and "step_00000001 after step 1" in result.stdout
    want, got = read_metrics(used), read_metrics(run_copy)
    assert [r["step"] for r in got] == [0, 1]
    assert compared(got, run_copy) == compared(want, used)


def kept(root: Path) -> dict[str, bytes]:
    """What a run directory holds besides the lock (which every launch takes)."""
    return {name: data for name, data in tree(root).items() if name != ".lock"}


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _damage(checkpoint: Path, how: str) -> None:
    data = sorted(checkpoint.glob("*.distcp"))[0]
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:100])
    elif how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        (checkpoint / how).unlink()


@pytest.mark.parametrize("hows", [("truncated", "truncated"), ("flipped", "trainer_state.pt")])
def test_resume_with_every_checkpoint_damaged_refuses_and_changes_nothing(run_copy, tmp_path, hows):
    for how, name in zip(hows, ("step_00000002", "step_00000001")):
        _damage(run_copy / "checkpoints" / name, how)
    before = kept(run_copy)
    result = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=1", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path)
    line = one_error_line(result)
    assert "every checkpoint of" in line and "step_00000002: " in line and "and 1 older one" in line, line
    assert "starting fresh" not in result.stdout
    assert kept(run_copy) == before  # metrics.jsonl, samples, config and every checkpoint as they were


def test_resume_of_a_run_with_logged_steps_and_no_checkpoint_refuses(run_copy, tmp_path):
    shutil.rmtree(run_copy / "checkpoints")  # a run without checkpoints (checkpoint.every=0), or killed before one
    before = kept(run_copy)
    result = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=0", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path)
    line = one_error_line(result)
    assert "holds 2 logged step(s) in metrics.jsonl but no checkpoint" in line, line
    assert kept(run_copy) == before


def _adopt_by_another_lineage(checkpoint: Path) -> str:
    marker = json.loads((checkpoint / "complete.json").read_text())
    marker["run_id"] = "another-lineage"  # the marker is not among its own digests: still an intact checkpoint
    (checkpoint / "complete.json").write_text(json.dumps(marker))
    return marker["run_id"]


def test_a_checkpoint_of_another_lineage_is_never_replaced_by_a_save(run_copy, tmp_path):
    foreign = run_copy / "checkpoints" / "step_00000002"
    _adopt_by_another_lineage(foreign)
    before = kept(run_copy)
    result = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=1", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path)
    line = one_error_line(result)
    assert f"{foreign} belongs to another run (run id another-lineage" in line and "saves step 2" in line, line
    assert kept(run_copy) == before


def test_a_save_never_replaces_another_lineages_checkpoint(run_copy):
    """The last guard, under the checkpointer's check: ``save_checkpoint`` itself (a stop signal's save)."""
    from fsdptrain.distributed.sharded_checkpoint import save_checkpoint

    foreign = run_copy / "checkpoints" / "step_00000002"
    _adopt_by_another_lineage(foreign)
    before = kept(run_copy)
    with pytest.raises(ValueError, match="is a checkpoint of another run .lineage another-lineage"):
        save_checkpoint(run_copy, 2, models={}, optimizers={}, schedulers={}, extra={}, run_id="mine")
    assert kept(run_copy) == before


@pytest.fixture(scope="module")
def lora_used(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("lora_used")
    result = run_cli("train", *TINY, "trainer.steps=1", "checkpoint.every=1", "model.lora.r=4", "trainer.run_name=l",
                     cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd / "runs" / "l"


@pytest.mark.parametrize(("base", "change", "culprit"), [
    ("full", "model.lora.r=8", "policy tensor(s) this run trains are not in it (model.layers.0.mlp.down_proj.lora_A"),
    ("full", "model.hidden_size=128", "differ in shape (lm_head.weight: [24, 64] in the checkpoint, [24, 128] here)"),
    ("lora", "model.lora.r=0", "policy tensor(s) in it are not trained here (model.layers.0.mlp.down_proj.lora_A"),
    ("lora", "model.lora.r=8", "lora_A.default.weight: [4, 128] in the checkpoint, [8, 128] here"),
])
def test_resume_across_a_shape_change_is_one_line_and_writes_nothing(request, tmp_path, base, change, culprit):
    source = request.getfixturevalue("used" if base == "full" else "lora_used")
    run_dir = tmp_path / "runs" / "x"
    shutil.copytree(source, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    before = kept(run_dir)
    lora = () if base == "full" else ("model.lora.r=4",)
    result = run_cli("train", *TINY, "trainer.steps=3", "checkpoint.every=1", *lora, change,
                     "trainer.allow_config_change=true", f"trainer.run_dir={run_dir}", "trainer.resume=auto",
                     cwd=tmp_path)
    line = one_error_line(result)
    assert "does not fit the models this run builds" in line and culprit in line, line
    assert kept(run_dir) == before  # not even config_changes.jsonl: the change did not happen


def _children(pid: int) -> list[int]:
    found = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(p) for p in path.read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_launcher_kills_its_ranks(tmp_path):
    run_dir = tmp_path / "runs" / "k"
    proc = subprocess.Popen([*cli_command(), "train", "--nproc", "2", *TINY, "trainer.steps=200",
                             f"trainer.run_dir={run_dir}"], cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its first step"
        time.sleep(0.1)
    ranks = _children(proc.pid)
    assert len(ranks) == 2, ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in ranks if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "ranks outlived their launcher"
    lines = (run_dir / "metrics.jsonl").read_text().count("\n")
    time.sleep(1.0)
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == lines  # nobody writes the run directory any more


def _torchrun(*args: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            "--max-restarts", str(restarts), "--no-python", *cli_command(), "train", *TINY, *args]


def _rank_pid(agent: int, rank: int) -> int | None:
    for pid in _children(agent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.slow  # CI time (about 25 s); run by hand with pytest -m slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_torchrun_restarts_a_killed_rank_and_resumes_exactly(tmp_path):
    common = ("trainer.steps=6", "checkpoint.every=1", "trainer.resume=auto")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = subprocess.run(_torchrun(*common, f"trainer.run_dir={tmp_path / 'ref'}"), cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "restarted"
    agent = subprocess.Popen(_torchrun(*common, f"trainer.run_dir={run_dir}", restarts=2), cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text().count("\n") < 3:
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
        time.sleep(0.05)
    victim = _rank_pid(agent.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    try:
        out, err = agent.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        agent.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
        agent.communicate()
        raise
    assert agent.returncode == 0, err[-3000:]
    assert "resumed from" in out
    got, want = read_metrics(run_dir), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(6))
    assert compared(got, run_dir) == compared(want, tmp_path / "ref")


def test_resume_never_runs_a_planted_checkpoint_metadata_and_falls_back(run_copy, tmp_path):
    newest = run_copy / "checkpoints" / "step_00000002"
    marker = tmp_path / "code-ran"
    payload = (b"cposix\nsystem\n(V" + f"echo ran > {marker}".encode() + b"\ntR.")  # pickle of os.system(...)
    (newest / ".metadata").write_bytes(payload)
    result = run_cli("train", *TINY, "trainer.steps=2", "checkpoint.every=1", f"trainer.run_dir={run_copy}",
                     "trainer.resume=auto", cwd=tmp_path)
    assert not marker.exists(), "the planted .metadata ran its code"
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipping damaged")]
    assert len(warnings) == 1 and f"{newest}: .metadata is truncated" in warnings[0], result.stderr[-3000:]
    assert "step_00000001 after step 1" in result.stdout
