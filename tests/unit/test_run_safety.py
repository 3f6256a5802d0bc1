"""Run-directory safety pieces on their own: atomic rewrites, the partial-tail rule, the lock, ownership and lineage
rotation, the safetensors header check."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.distributed.sharded_checkpoint import MARKER, prune_checkpoints
from fsdptrain.storage.atomic import append_line, read_jsonl_dropping_partial_tail, write_atomic
from fsdptrain.model.checks import safetensors_problem
from fsdptrain.run.ownership import claim_run_dir, config_changes, lock_run_dir, record_config_change, run_id


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_partial_last_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    append_line(path, json.dumps({"step": 0}))
    append_line(path, json.dumps({"step": 1}))
    with path.open("a") as handle:
        handle.write('{"step": 2, "reward/me')
    assert read_jsonl_dropping_partial_tail(path) == [{"step": 0}, {"step": 1}]
    assert "dropped a partial last line" in capsys.readouterr().err


def test_a_bad_line_before_the_end_is_corruption(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_jsonl_dropping_partial_tail(path)


def test_lock_refuses_a_second_process_and_is_released_when_the_holder_dies(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from fsdptrain.run.ownership import lock_run_dir
        lock_run_dir(Path({str(tmp_path)!r}))
        print("locked", flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"in use by another fsdptrain run \\(pid {holder.pid}\\)"):
            lock_run_dir(tmp_path)
    finally:
        holder.kill()  # SIGKILL: the kernel releases the flock
        holder.wait()
    lock_run_dir(tmp_path)


def test_a_used_run_dir_needs_resume_or_overwrite(tmp_path):
    cfg = compose_config([])
    first = claim_run_dir(cfg, tmp_path, "trainer.run_dir=X")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already holds a run: continue it with trainer.run_dir=X trainer.resume"):
        claim_run_dir(cfg, tmp_path, "trainer.run_dir=X")
    assert claim_run_dir(compose_config(["trainer.resume=auto"]), tmp_path, "w") == first
    second = claim_run_dir(compose_config(["trainer.overwrite=true"]), tmp_path, "w")
    assert second != first and run_id(tmp_path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run.json"]


def test_config_change_on_resume_is_refused_or_recorded(tmp_path):
    old = compose_config([])
    (tmp_path / "config.yaml").write_text(__import__("omegaconf").OmegaConf.to_yaml(old))
    (tmp_path / "metrics.jsonl").write_text("")
    new = ["trainer.resume=auto", "model.hidden_size=128", "loss.agg_mode=token-sum"]
    assert config_changes(old, compose_config(new)) == {"loss.agg_mode": ["token-mean", "token-sum"],
                                                        "model.hidden_size": [64, 128]}
    with pytest.raises(ConfigError, match="model.hidden_size: 64 -> 128, loss.agg_mode: 'token-mean' -> 'token-sum'"):
        claim_run_dir(compose_config(new), tmp_path, "w")
    allowed = compose_config([*new, "trainer.allow_config_change=true"])
    claim_run_dir(allowed, tmp_path, "w")
    assert not (tmp_path / "config_changes.jsonl").exists()  # recorded only once the checkpoint has loaded
    record_config_change(allowed, tmp_path)
    record = json.loads((tmp_path / "config_changes.jsonl").read_text())
    assert record["changes"]["model.hidden_size"] == [64, 128]


def _fake_checkpoint(run_dir: Path, step: int, owner: str | None) -> Path:
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps({"step": step, "run_id": owner}))
    return folder


def test_rotation_deletes_only_this_lineage(tmp_path):
    old = [_fake_checkpoint(tmp_path, s, "old") for s in (7, 8)]
    mine = [_fake_checkpoint(tmp_path, s, "new") for s in (1, 2, 3)]
    deleted = prune_checkpoints(tmp_path, 2, run_id="new")
    assert deleted == [mine[0]]
    assert all(p.is_dir() for p in old + mine[1:])


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_safetensors_header_check(tmp_path):
    good = _safetensors(tmp_path / "a.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                        b"\0" * 8)
    assert safetensors_problem(good) is None
    short = _safetensors(tmp_path / "b.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                         b"\0" * 4)
    assert "truncated" in safetensors_problem(short)
    (tmp_path / "c.safetensors").write_bytes(b"\xff" * 64)
    assert "damaged header" in safetensors_problem(tmp_path / "c.safetensors")


ROW = {"prompt": "1+1=", "response": "2", "reward": 1.0}


@pytest.mark.parametrize(("extra", "message"), [
    ({"truncated": "false"}, "'truncated' must be a JSON boolean"),
    ({"truncated": 0}, "'truncated' must be a JSON boolean"),
    ({"behaviour_logprobs": [float("nan"), -0.1]}, "finite log-probabilities <= 0, got nan"),
    ({"behaviour_logprobs": [1e30, -0.1]}, "got 1e+30"),
    ({"behaviour_logprobs": [0.5, -0.1]}, "got 0.5"),
])
def test_jsonl_rows_are_typed_strictly(tmp_path, extra, message):
    from fsdptrain.data.offline_rollouts import DataError, load_jsonl_rollouts
    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, **extra}) + "\n")
    tokenizer = load_bundled_tokenizer()
    with pytest.raises(DataError, match=f"r.jsonl:2: .*{re.escape(message)}"):
        load_jsonl_rollouts(str(path), tokenizer, max_response_length=8, skip_bad_rows=False)
    rollouts, skipped = load_jsonl_rollouts(str(path), tokenizer, max_response_length=8, skip_bad_rows=True)
    assert (len(rollouts), skipped) == (1, 1)


USERS_FILES = {"config.yaml": "lr: 3\n", "samples.jsonl": '{"q": 1}\n', "notes.txt": "mine\n"}


@pytest.mark.parametrize("flags", [[], ["trainer.resume=auto"], ["trainer.overwrite=true"]])
def test_a_folder_of_the_users_own_files_is_refused_and_left_as_it_was(tmp_path, flags):
    for name, text in USERS_FILES.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=f"trainer.run_dir=X: {tmp_path} holds files fsdptrain did not write "
                                          r"\(config.yaml, notes.txt, samples.jsonl\)"):
        claim_run_dir(compose_config(flags), tmp_path, "trainer.run_dir=X")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == USERS_FILES


def test_which_folders_are_fsdptrains_own(tmp_path):
    from fsdptrain.run.ownership import foreign_entries

    assert foreign_entries(tmp_path / "missing") == [] and foreign_entries(tmp_path) == []
    (tmp_path / ".lock").write_text("1\n")
    assert foreign_entries(tmp_path) == []  # the lock is fsdptrain's
    (tmp_path / "config.yaml").write_text("x: 1\n")
    assert foreign_entries(tmp_path) == ["config.yaml"]  # a config.yaml alone is no run
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    assert foreign_entries(tmp_path) == []  # a run written before run.json existed
    (tmp_path / "notes.txt").write_text("mine")
    assert foreign_entries(tmp_path) == ["config.yaml", "metrics.jsonl", "notes.txt"]
    (tmp_path / "run.json").write_text('{"run_id": "a"}\n')
    assert foreign_entries(tmp_path) == []  # claimed by fsdptrain: the user's notes next to the run are kept


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "a/b", "..", ".", "a\\b", " "])
def test_run_name_must_be_a_plain_name(name):
    with pytest.raises(ConfigError, match=f"trainer.run_name={re.escape(repr(name))} must be a plain name"):
        compose_config([f"trainer.run_name='{name}'"])


def test_unnamed_runs_started_in_the_same_second_get_different_folders():
    from fsdptrain.cli import _default_run_name

    names = [_default_run_name() for _ in range(20)]
    assert len(set(names)) == 20 and all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", n) for n in names), names


def test_a_yaml_syntax_error_in_the_users_config_names_file_and_line(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  steps: [1\n  lr: 2\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'mine.yaml'))}:6: not valid YAML "):
        compose_config([], config_dir=str(tmp_path), config_name="mine")


def test_unnamed_ranks_under_torchrun_agree_on_the_rendezvous_id(monkeypatch):
    from fsdptrain.cli import _default_run_name

    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "ab-12")):
        monkeypatch.setenv(name, value)
    assert _default_run_name() == _default_run_name() == "torchrun-ab12"


def test_shape_mismatch_names_the_first_difference_of_each_kind():
    import torch

    from fsdptrain.distributed.sharded_checkpoint import shape_mismatch

    saved = {"models.policy.a": (4, 3), "models.policy.b": (2,), "models.policy.old": (1,), "optimizers.policy.x": (9,),
             "models.critic.a": (4, 3)}
    same = {"policy": {"a": torch.zeros(4, 3), "b": torch.zeros(2), "old": torch.zeros(1)},
            "critic": {"a": torch.zeros(4, 3)}}
    assert shape_mismatch(saved, same) is None
    changed = {"policy": {"a": torch.zeros(8, 3), "b": torch.zeros(2), "new": torch.zeros(1)}}
    assert shape_mismatch(saved, changed) == (
        "1 policy tensor(s) differ in shape (a: [4, 3] in the checkpoint, [8, 3] here); 1 policy tensor(s) this run "
        "trains are not in it (new); 1 policy tensor(s) in it are not trained here (old)")
    assert shape_mismatch(saved, {"critic": {"a": torch.zeros(4, 3), "c": torch.zeros(1)}}) == (
        "1 critic tensor(s) this run trains are not in it (c)")
