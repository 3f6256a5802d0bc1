"""Checkpoints: exact resume, resume on 2 ranks from a 1-rank checkpoint, a crash inside the writer, rotation,
HF export; plus the folder rules (marker, temp folders, rotation) on hand-made folders.

Three launches of workers/ckpt_worker.py, in order (each depends on the folders the previous one left):
  train (1 rank)         run A: steps 1-6, checkpoints after 1-4 with keep 3, export after step 6
  resume_crash (1 rank)  A/step_2 -> steps 3-4 -> save B/step_4 -> step 5 -> save B/step_5, killed in DCP's writer
                         by crash_in_writer/sitecustomize.py on PYTHONPATH
  reshard (2 ranks)      latest_checkpoint(B) (= step 4) -> steps 5-6 -> save B/step_6 -> export B
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from fsdptrain.distributed import sharded_checkpoint as ckpt

from fsdptrain.storage import checkpoint_folders as folders
from tests.dist.launch import LaunchResult, launch

WORKER = "ckpt_worker.py"
CRASH_PATCH = Path(__file__).resolve().parent / "workers" / "crash_in_writer"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    run_a, run_b = root / "run_a", root / "run_b"
    common = ("--run-a", str(run_a), "--run-b", str(run_b))
    train = launch(WORKER, nproc=1, out_dir=root / "out_train", args=("--phase", "train", *common)).checked(1)
    return {"root": root, "run_a": run_a, "run_b": run_b, "common": common, "train": train}


@pytest.fixture(scope="module")
def crashed(runs) -> dict:
    mp = pytest.MonkeyPatch()
    # The patch reaches the workers through the environment the launcher copies (tests/dist/launch.py).
    mp.setenv("PYTHONPATH", str(CRASH_PATCH))
    try:
        result = launch(WORKER, nproc=1, out_dir=runs["root"] / "out_crash",
                        args=("--phase", "resume_crash", *runs["common"]))
    finally:
        mp.undo()
    checkpoints = sorted(p.name for p in (runs["run_b"] / "checkpoints").iterdir())
    latest = folders.latest_checkpoint(runs["run_b"])
    return {"result": result, "checkpoints_after_crash": checkpoints, "latest_after_crash": latest}


@pytest.fixture(scope="module")
def resharded(runs, crashed) -> LaunchResult:
    return launch(WORKER, nproc=2, out_dir=runs["root"] / "out_reshard",
                  args=("--phase", "reshard", *runs["common"])).checked(2)


def _steps(result: dict, first: int, last: int) -> list[dict]:
    by_step = {entry["step"]: entry for entry in result["steps"]}
    return [by_step[k] for k in range(first, last + 1)]


def test_rotation_keeps_the_newest_three(runs):
    names = sorted(p.name for p in (runs["run_a"] / "checkpoints").iterdir())
    # saves after steps 1, 2, 3, 4 with keep=3: step 1 went when step 4 arrived; no temp folder is left over
    assert names == ["step_00000002", "step_00000003", "step_00000004"]
    assert runs["train"].results[0]["latest"].endswith("step_00000004")
    info = folders.checkpoint_info(runs["run_a"] / "checkpoints" / "step_00000002")
    assert info["step"] == 2 and info["world_size"] == 1
    assert info["models"] == ["critic", "policy"] and info["optimizers"] == ["critic", "policy"]


def test_losses_change_every_step(runs):
    # Guards the resume comparisons below: a loop whose losses did not move would match trivially.
    steps = runs["train"].results[0]["steps"]
    pg = [s["pg_loss"] for s in steps]
    vf = [s["vf_loss"] for s in steps]
    assert len(set(pg)) == 6 and len(set(vf)) == 6, (pg, vf)


def test_resume_reproduces_steps_3_and_4_exactly(runs, crashed):
    result = crashed["result"]
    assert 0 in result.results, result.describe()
    resumed = result.results[0]
    original = runs["train"].results[0]
    assert resumed["extra"] == {"step": 2, "data_position": 8, "num_nonfinite": 20, "note": ["plain", 1.5, None]}
    # The scheduler came back: warmup factor (k+1)/3 after 2 scheduler steps is 1, so lr = 1e-2 (not 1/3 of it).
    assert resumed["lr_after_load"] == {"policy": [pytest.approx(1e-2, abs=1e-12)],
                                        "critic": [pytest.approx(1e-2, abs=1e-12)]}
    assert resumed["rng_after_load"] == original["rng_at_2"]
    for got, want in zip(_steps(resumed, 3, 5), _steps(original, 3, 5)):
        assert got["pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-6, rel=0)
        assert got["vf_loss"] == pytest.approx(want["vf_loss"], abs=1e-6, rel=0)
        assert got["draws"] == want["draws"]


def test_resume_restores_the_optimizer_state(runs, crashed):
    saved = torch.load(runs["root"] / "out_train" / "optim_at_2.pt", weights_only=True)
    loaded = torch.load(runs["root"] / "out_crash" / "optim_after_load.pt", weights_only=True)
    assert saved.keys() == loaded.keys() == {"policy", "critic"}
    for name in saved:
        assert saved[name]["param_groups"] == loaded[name]["param_groups"]
        assert saved[name]["state"].keys() == loaded[name]["state"].keys()
        for fqn, entries in saved[name]["state"].items():
            assert entries.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key, tensor in entries.items():
                assert torch.equal(tensor, loaded[name]["state"][fqn][key]), (name, fqn, key)
            assert float(entries["step"]) == 2.0


def test_crash_inside_the_writer_leaves_the_previous_checkpoint(runs, crashed):
    result = crashed["result"]
    assert result.returncode != 0, result.describe()
    assert "exiting inside FileSystemWriter.write_data (call 2)" in result.output, result.describe()
    assert crashed["checkpoints_after_crash"] == [".tmp_step_00000005", "step_00000004"]
    half_written = runs["run_b"] / "checkpoints" / ".tmp_step_00000005"
    assert list(half_written.glob("*.distcp")), "the patch should kill the save after its data files were written"
    assert not (half_written / folders.MARKER).exists()
    assert crashed["latest_after_crash"] == runs["run_b"] / "checkpoints" / "step_00000004"


def test_one_rank_checkpoint_resumes_on_two_ranks(runs, resharded):
    original = runs["train"].results[0]
    for rank, result in resharded.results.items():
        assert result["resumed_from"].endswith("step_00000004"), rank
        assert result["extra"]["step"] == 4 and result["extra"]["data_position"] == 16
        assert result["temp_dirs_after_load"] == [], "load_checkpoint removes the crashed save's temp folder"
        # Same global batch, split over 2 ranks: only rounding differs from the 1-rank run.
        for got, want in zip(_steps(result, 5, 6), _steps(original, 5, 6)):
            assert got["pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5, rel=0)
            assert got["vf_loss"] == pytest.approx(want["vf_loss"], abs=1e-5, rel=0)
    # Rank 0 has its saved RNG state, so it continues the 1-rank run's draws; rank 1 derives its own.
    assert [s["draws"] for s in _steps(resharded.results[0], 5, 6)] == [s["draws"] for s in _steps(original, 5, 6)]
    saved_rank0 = torch.load(runs["run_b"] / "checkpoints" / "step_00000004" / "rng_rank0.pt", weights_only=True)
    seed = ckpt.derived_rng_seed(saved_rank0["torch"], 1)
    expected_torch = torch.Generator().manual_seed(seed).get_state()
    assert resharded.results[1]["rng_after_load"] == {
        "torch": hashlib.sha256(expected_torch.numpy().tobytes()).hexdigest(),
        "python": hashlib.sha256(repr(random.Random(seed).getstate()).encode()).hexdigest(),
    }


def test_two_rank_save_writes_every_rank_and_rotates(runs, resharded):
    names = sorted(p.name for p in (runs["run_b"] / "checkpoints").iterdir())  # B/step_5 never completed
    assert names == ["step_00000004", "step_00000006"]
    step6 = runs["run_b"] / "checkpoints" / "step_00000006"
    assert folders.checkpoint_info(step6)["world_size"] == 2
    assert (step6 / "rng_rank0.pt").is_file() and (step6 / "rng_rank1.pt").is_file()
    extra = torch.load(step6 / folders.TRAINER_STATE, weights_only=True)["extra"]
    assert extra["step"] == 6 and extra["data_position"] == 24


@pytest.mark.parametrize("kind", ["policy", "critic"])
@pytest.mark.parametrize("world", ["one_rank", "two_ranks"])
def test_export_loads_with_transformers_and_gives_the_trained_outputs(request, runs, world, kind):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    if world == "two_ranks":
        request.getfixturevalue("resharded")
    run_dir, out_dir = {"one_rank": ("run_a", "out_train"), "two_ranks": ("run_b", "out_reshard")}[world]
    folder = runs[run_dir] / "export" / kind
    assert sorted(p.suffix for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")) == [
        ".safetensors"
    ]
    auto = AutoModelForCausalLM if kind == "policy" else AutoModelForTokenClassification
    model = auto.from_pretrained(folder, dtype=torch.float32).eval()
    ref = torch.load(runs["root"] / out_dir / "export_ref.pt", weights_only=True)
    with torch.no_grad():
        out = model(input_ids=ref["ids"], use_cache=False).logits
    want = ref["logits"] if kind == "policy" else ref["values"]
    assert out.shape == want.shape
    assert torch.allclose(out, want, rtol=0, atol=1e-6), (out - want).abs().max()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids("repeat") == 14  # 4 specials, the digits 0-9, then the task words
    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    assert tokenizer.get_vocab() == load_bundled_tokenizer().get_vocab()


# ---------------------------------------------------------------------------------------------------------------
# Folder rules on hand-made folders (no process group)
# ---------------------------------------------------------------------------------------------------------------


def _fake_checkpoint(run_dir: Path, name: str, *, marker: bool) -> Path:
    path = run_dir / "checkpoints" / name
    path.mkdir(parents=True)
    if marker:
        (path / folders.MARKER).write_text(json.dumps({"step": 0}))
    return path


def test_latest_checkpoint_ignores_incomplete_and_temp_folders(tmp_path):
    assert folders.latest_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, "step_00000002", marker=True)
    _fake_checkpoint(tmp_path, "step_00000010", marker=True)
    _fake_checkpoint(tmp_path, "step_00000011", marker=False)  # a folder without its marker is not complete
    _fake_checkpoint(tmp_path, ".tmp_step_00000012", marker=True)  # marker written, rename not done: temp
    _fake_checkpoint(tmp_path, "step_12", marker=True)  # not our naming
    # numeric order, not the order of creation: 10 > 2
    assert folders.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000010"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        folders.checkpoint_info(tmp_path / "checkpoints" / "step_00000011")


def test_prune_keeps_the_newest_and_drops_temp_folders(tmp_path):
    for step in (1, 3, 5, 7):
        _fake_checkpoint(tmp_path, f"step_{step:08d}", marker=True)
    _fake_checkpoint(tmp_path, ".tmp_step_00000009", marker=False)
    deleted = folders.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == [".tmp_step_00000009", "step_00000001", "step_00000003"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000005", "step_00000007"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        folders.prune_checkpoints(tmp_path, keep=0)


def test_extra_must_be_plain_data(tmp_path):
    with pytest.raises(ValueError, match=r"extra\[.pos.\] is a \w*Path:"):
        ckpt.save_checkpoint(tmp_path, 1, models={}, optimizers={}, schedulers={}, extra={"pos": Path("x")})
    assert not (tmp_path / "checkpoints").exists()


def test_optimizer_without_a_model_and_incomplete_folder_are_refused(tmp_path):
    param = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"optimizers \['critic'\] have no model of the same name"):
        ckpt.save_checkpoint(tmp_path, 1, models={}, optimizers={"critic": torch.optim.SGD([param], lr=0.1)},
                             schedulers={}, extra={})
    half = _fake_checkpoint(tmp_path, ".tmp_step_00000003", marker=False)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(half, models={}, optimizers={}, schedulers={})
