"""Bad input, table-driven, through the real CLI: every case exits with its code, prints one line naming the culprit
on stderr, no traceback, and leaves the run directory (and any earlier checkpoint) as it was.

Families: config (generated from the schema: every float field refuses nan, every int field refuses -1, so a new
field is covered without touching this file), model folders, data files, the filesystem, devices, resume (one real
run shared by every resume case) and ``--nproc 2`` (the parent reports once). Kills and signals are in
tests/e2e/test_run_dir_safety.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fsdptrain.config.validate import schema_fields
from tests.conftest import run_cli

TINY = ("rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
        "logging.progress=false")


@dataclass
class Case:
    id: str
    args: tuple[str, ...]
    culprit: str
    code: int = 2
    run: str = "fresh"
    """fresh: runs/case (must hold no run afterwards); used: the shared real run (must be byte-identical)."""
    command: str = "train"
    env: dict = field(default_factory=dict)
    needs: str = ""
    """cpu-only: skipped where a GPU is present."""


def _config_cases() -> list[Case]:
    cases = [Case(f"float-nan-{key}", (f"{key}=nan",), f"{key}=nan") for key in schema_fields(float)]
    cases += [Case(f"int-negative-{key}", (f"{key}=-1",), f"{key}=-1") for key in schema_fields(int)]
    return cases + [
        Case("unknown-key", ("trainer.lrr=0.1",), "trainer.lrr"),
        Case("renamed-key", ("data.max_response_length=8",), "set rollout.max_new_tokens instead"),
        Case("bad-choice", ("loss.agg_mode=token_sum",), "loss.agg_mode='token_sum'"),
        Case("int-not-int", ("trainer.steps=1.5",), "trainer.steps"),
        Case("lr-inf", ("trainer.lr=inf",), "trainer.lr=inf"),
        Case("clip-ratio-c-below-1", ("algorithm.clip_ratio_c=0.5",), "algorithm.clip_ratio_c=0.5"),
        Case("lam-negative", ("algorithm.lam=-5",), "algorithm.lam=-5.0"),
        Case("local-preset-without-path", ("model=local",), "model.path"),
        Case("overwrite-and-resume", ("trainer.overwrite=true", "trainer.resume=auto"), "trainer.overwrite"),
        Case("config-dir-missing", ("--config-dir", "{tmp}/nope"), "--config-dir"),
        Case("lora-targets-match-nothing", ("model.lora.r=8", "model.lora.target_modules=[q_proj,qkv]"),
             "'qkv' matches no linear module of LlamaForCausalLM; its linear modules are: down_proj, gate_proj"),
    ]


def _model_cases() -> list[Case]:
    names = {"missing": "no such folder", "empty": "has no config.json", "config-only": "has no weights",
             "bert": "BertModel, not a causal LM", "no-tokenizer": "has no tokenizer",
             "truncated-weights": "model.safetensors is truncated", "bad-header": "model.safetensors has a damaged",
             "a-file": "is a file, not a folder", "config-not-json": "config.json is not valid JSON"}
    cases = [Case(f"model-{name}", ("model=local", f"model.path={{inputs}}/{name}"), message)
             for name, message in names.items()]
    return cases + [
        Case("model-hub-name", ("model=local", "model.path=Qwen/Qwen2.5-0.5B"), "never downloads"),
        Case("model-hub-name-short", ("model=local", "model.path=gpt2"), "model.path='gpt2'"),
        Case("model-missing-nproc-2", ("--nproc", "2", "model=local", "model.path={inputs}/missing"), "no such folder"),
    ]


def _data_cases() -> list[Case]:
    jsonl = ("data=jsonl", "rollout.max_new_tokens=8")
    return [
        Case("data-binary", (*jsonl, "data.path={inputs}/binary.jsonl"), "is a binary file"),
        Case("data-not-utf8", (*jsonl, "data.path={inputs}/latin1.jsonl"), "is not UTF-8 text"),
        Case("data-missing", (*jsonl, "data.path={inputs}/nope.jsonl"), "data.path="),
        Case("data-a-folder", (*jsonl, "data.path={inputs}"), "is a folder, not a regular file"),
        Case("data-truncated-string-nproc-2", ("--nproc", "2", *jsonl, "data.path={inputs}/truncated_string.jsonl"),
             "'truncated' must be a JSON boolean"),
        Case("data-nan-logprob", (*jsonl, "data.path={inputs}/nan_logprob.jsonl"), "behaviour_logprobs"),
    ]


def _filesystem_cases() -> list[Case]:
    return [
        Case("run-dir-under-a-file", ("trainer.run_dir={inputs}/a-file/run",), "which is a file"),
        Case("run-dir-is-a-file", ("trainer.run_dir={inputs}/a-file",), "is a file"),
        Case("run-dir-not-writable", ("trainer.run_dir=/sys/fsdptrain-run",), "is not writable"),
        Case("run-dir-no-space", (), "has no space left", env={"PATCH": "no_space"}),
        Case("run-dir-is-a-file-nproc-2", ("--nproc", "2", "trainer.run_dir={inputs}/a-file"), "is a file"),
        Case("check-json-unwritable", ("--json", "/sys/fsdptrain-check.json"), "cannot be written",
             command="check-metrics"),
        Case("check-json-a-folder", ("--json", "{inputs}"), "is a folder", command="check-metrics"),
        Case("check-json-no-folder", ("--json", "{inputs}/nope/c.json"), "does not exist", command="check-metrics"),
        Case("device-cuda-without-gpu", ("trainer.device=cuda",), "trainer.device=cuda", needs="cpu-only"),
        Case("flash-attn-on-cpu", ("trainer.device=cpu", "model.attn_backend=flash_attn"), "model.attn_backend",
             needs="cpu-only"),
    ]


def _resume_cases() -> list[Case]:
    used = dict(run="used")
    return [
        Case("reuse-without-resume", (), "already holds a run", **used),
        Case("reuse-without-resume-nproc-2", ("--nproc", "2"), "trainer.resume=auto", **used),
        Case("second-writer", ("trainer.resume=auto",), "in use by another fsdptrain run", env={"LOCK": "1"}, **used),
        Case("resume-changes-model", ("trainer.resume=auto", "model.hidden_size=128"), "model.hidden_size", **used),
        Case("resume-changes-algorithm", ("trainer.resume=auto", "algorithm=grpo"), "algorithm.adv_estimator", **used),
        Case("resume-changes-loss-mode", ("trainer.resume=auto", "loss.agg_mode=token-sum"), "loss.agg_mode",
             **used),
        Case("resume-changes-model-nproc-2", ("--nproc", "2", "trainer.resume=auto", "model.num_layers=3"),
             "model.num_layers", **used),
        Case("resume-steps-below-checkpoint", ("trainer.resume=auto", "trainer.steps=1"), "trainer.steps=1", **used),
        Case("resume-other-prompts-per-step", ("trainer.resume=auto", "rollout.prompts_per_step=8"),
             "rollout.prompts_per_step", **used),
    ]


CASES = _config_cases() + _model_cases() + _data_cases() + _filesystem_cases() + _resume_cases()
NO_SPACE_PATCH = """
    import shutil
    _usage = shutil.disk_usage
    def disk_usage(path):
        return _usage(path)._replace(free=1024)
    shutil.disk_usage = disk_usage
"""


# ---- inputs, built once -----------------------------------------------------------------------------------------------


def _tiny_llama(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdptrain.data.tokenizer import load_bundled_tokenizer

    tokenizer = load_bundled_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("inputs")
    good = root / "good-model"
    _tiny_llama(good)
    (root / "empty").mkdir()
    (root / "config-only").mkdir()
    shutil.copy(good / "config.json", root / "config-only")
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(root / "bert")
    shutil.copy(good / "tokenizer.json", root / "bert")
    shutil.copytree(good, root / "no-tokenizer", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    shutil.copytree(good, root / "truncated-weights")
    weights = root / "truncated-weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    shutil.copytree(good, root / "bad-header")
    (root / "bad-header" / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    shutil.copytree(good, root / "config-not-json")
    (root / "config-not-json" / "config.json").write_text("{not json")
    (root / "a-file").write_text("not a folder\n")
    row = {"prompt": "1+1=", "response": "2", "reward": 1.0}
    (root / "binary.jsonl").write_bytes(b"\x00\x01\x02" + os.urandom(64))
    (root / "latin1.jsonl").write_bytes(json.dumps({**row, "prompt": "caf\u00e9"}, ensure_ascii=False)
                                        .encode("latin-1") + b"\n")
    lines = [json.dumps(row), json.dumps({**row, "truncated": "false"})]
    (root / "truncated_string.jsonl").write_text("\n".join(lines) + "\n")
    (root / "nan_logprob.jsonl").write_text(json.dumps({**row, "behaviour_logprobs": [float("nan"), -0.1]}) + "\n")
    return root


@pytest.fixture(scope="module")
def used_run(tmp_path_factory) -> Path:
    """One real 2-step run with checkpoints after steps 1 and 2: every resume case must leave it byte-identical."""
    cwd = tmp_path_factory.mktemp("used")
    result = run_cli("train", *TINY, "trainer.steps=2", "checkpoint.every=1", "trainer.run_name=used", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd / "runs" / "used"


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (the lock file aside) with the sha256 of its bytes."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


GENERATED = [c for c in CASES if c.id.startswith(("float-nan-", "int-negative-"))]


@pytest.fixture(scope="module")
def generated_results(tmp_path_factory) -> dict:
    """The schema-generated cases fail in composition (no run directory is touched): run them 4 at a time."""
    from concurrent.futures import ThreadPoolExecutor

    cwd = tmp_path_factory.mktemp("generated")

    def one(case: Case):
        return case.id, run_cli("train", *case.args, f"trainer.run_dir={cwd}/runs/{case.id}", cwd=cwd, timeout=300)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, GENERATED))


# ---- the table --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, inputs, tmp_path, request):
    if case.needs == "cpu-only":
        import torch

        if torch.cuda.is_available():
            pytest.skip("needs a machine without a GPU")
    run_dir = request.getfixturevalue("used_run") if case.run == "used" else tmp_path / "runs" / "case"
    args = [a.format(inputs=inputs, tmp=tmp_path) for a in case.args]
    if case.command == "train" and not any(a.startswith("trainer.run_dir=") for a in args):
        args.append(f"trainer.run_dir={run_dir}")
    if case.command == "train":
        args += [a for a in TINY if a.split("=")[0] + "=" not in " ".join(args)]
        if case.run == "used":
            args.append("checkpoint.every=1")
    env = {}
    if case.env.get("PATCH") == "no_space":
        patch = tmp_path / "patch"
        patch.mkdir()
        (patch / "sitecustomize.py").write_text(textwrap.dedent(NO_SPACE_PATCH))
        env["PYTHONPATH"] = os.pathsep.join([str(patch), os.environ.get("PYTHONPATH", "")])
    if case in GENERATED:
        result = request.getfixturevalue("generated_results")[case.id]
        run_dir = tmp_path.parent / "generated" / "runs" / case.id
        _assert_one_line(result, case)
        assert not run_dir.exists()
        return
    before = snapshot(run_dir)
    lock = None
    if case.env.get("LOCK"):
        lock = open(run_dir / ".lock", "a+")
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        result = run_cli(case.command, *args, cwd=tmp_path, env=env, timeout=300)
    finally:
        if lock is not None:
            lock.close()
    _assert_one_line(result, case)
    after = snapshot(run_dir)
    if case.run == "used":
        assert after == before
    else:
        assert set(after) <= {"run.json"}, sorted(after)  # a start that failed holds no run


def _assert_one_line(result, case: Case) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == case.code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ") and case.culprit in lines[0], lines[0]


def test_the_table_is_big_enough():
    families = {c.id.split("-")[0] for c in CASES}
    assert len(CASES) >= 60 and {"float", "int", "model", "data", "run", "check", "resume", "reuse"} <= families
