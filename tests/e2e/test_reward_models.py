"""Learned reward models through the real CLI: a reward model with its own tokenizer and chat template trains with
the policy, its logged scores are the ones transformers gives each sample alone, running normalisation resumes
exactly, bad folders are one line and exit 2, and a reward model whose score is a known function of the text is
learnt (docs/reward-models.md)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from fsdptrain.model.reward_model import load_full_reward_model, load_reward_model_spec, reward_input_ids
from tests.conftest import metric_kinds
from tests.e2e.test_resume_export import assert_same_metrics, read_metrics
from tests.helpers.reward_model_folders import CHAT_TEMPLATE, char_tokenizer, save_reward_model, save_seven_reward_model

TINY = ("algorithm=grpo", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
        "trainer.eval_every=0", "logging.progress=false", "trainer.lr_schedule=constant", "logging.samples_every=1")
TOL = 1e-5


@pytest.fixture(scope="module")
def chat_reward_model(tmp_path_factory) -> Path:
    """A Llama reward model with the character-level tokenizer and a chat template (the policy's is word-level)."""
    return save_reward_model(tmp_path_factory.mktemp("rm") / "chat", tokenizer=char_tokenizer(CHAT_TEMPLATE), seed=3)


def read_samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def alone_scores(folder: Path, samples: list[dict]) -> list[float]:
    """Each sample scored alone by transformers' own forward and pooling, fp32."""
    spec = load_reward_model_spec(folder)
    model = load_full_reward_model(spec)
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([reward_input_ids(spec, s["prompt"], s["completion"])])).logits[0, 0])
                for s in samples]


def whitened(values: list[float], seen: list[float]) -> list[float]:
    """(v - mean) / sqrt(unbiased var + 1e-8) with the moments of ``seen``."""
    mean = sum(seen) / len(seen)
    var = sum((x - mean) ** 2 for x in seen) / (len(seen) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reward_model_with_its_own_tokenizer_trains_and_resumes_exactly(cli, tmp_path, chat_reward_model):
    args = (*TINY, f"reward.models=[{chat_reward_model}]", "reward.model_normalize=running", "reward.model_weights=[2.0]",
            "trainer.steps=3", "checkpoint.every=2")
    full = tmp_path / "runs" / "full"
    result = cli("train", *args, "trainer.run_name=full")
    assert result.returncode == 0, result.stderr
    rows, samples = read_metrics(full), read_samples(full)
    assert len(rows) == 3
    seen: list[float] = []
    for step, row in enumerate(rows):
        mine = [s for s in samples if s["step"] == step]
        assert len(mine) == 4  # every sample of the step (2 prompts x 2)
        raw = alone_scores(chat_reward_model, mine)
        seen += raw
        assert row["reward_model/0/raw/mean"] == pytest.approx(sum(raw) / 4, abs=TOL)
        assert row["reward_model/0/raw/min"] == pytest.approx(min(raw), abs=TOL)
        assert row["reward_model/0/raw/max"] == pytest.approx(max(raw), abs=TOL)
        scaled = whitened(raw, seen)  # the running moments of every score so far, this step's included
        assert [s["rewards"]["reward_model/0"] for s in mine] == pytest.approx(scaled, abs=1e-4)
        assert [s["total"] for s in mine] == pytest.approx([2.0 * x for x in scaled], abs=1e-4)
        assert row["reward/mean"] == pytest.approx(2.0 * sum(scaled) / 4, abs=1e-4)

    resumed = tmp_path / "runs" / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    result = cli("train", *args, "trainer.run_name=resumed", "trainer.resume=auto")
    assert result.returncode == 0, result.stderr
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [2]
    assert_same_metrics(again[0], rows[2], metric_kinds(full), tol=1e-9)  # the running moments came back: the scaled scores agree


def _causal(folder: Path) -> Path:
    return save_reward_model(folder, causal=True)


def _two_labels(folder: Path) -> Path:
    return save_reward_model(folder, num_labels=2)


def _no_tokenizer(folder: Path) -> Path:
    save_reward_model(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


@pytest.mark.parametrize("make, says", [
    (_causal, "is a causal LM"), (_two_labels, "num_labels=2"), (_no_tokenizer, "has no tokenizer files"),
    (lambda folder: folder, "does not exist"),
])
def test_a_bad_reward_model_folder_is_one_line_and_exit_2(cli, tmp_path, make, says):
    folder = make(tmp_path / "bad_rm")
    result = cli("train", *TINY, f"reward.models=[{folder}]", "trainer.steps=1")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and str(folder) in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_policy_learns_what_a_known_reward_model_rewards(cli, tmp_path):
    """The reward model scores 1 when a completion ends in "7" (tests/helpers/reward_model_folders.py): the policy
    learns it."""
    seven = save_seven_reward_model(tmp_path / "seven")
    result = cli("train", "algorithm=grpo", "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4",
                 "trainer.eval_every=0", "logging.progress=false", "trainer.lr_schedule=constant",
                 "trainer.steps=20", f"reward.models=[{seven}]", "checkpoint.every=0", "trainer.run_name=seven")
    assert result.returncode == 0, result.stderr
    rewards = [r["reward_model/0/raw/mean"] for r in read_metrics(tmp_path / "runs" / "seven")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, [round(r, 3) for r in rewards]


@pytest.mark.slow  # CI time; tests/dist/test_reward_model.py proves 2 ranks score as one process
def test_two_ranks_score_and_step_as_one_process(cli, tmp_path, chat_reward_model):
    """`rollout.top_p` far below any token's probability makes sampling pick the most likely token whatever the rank's
    seed, so 1 and 2 ranks generate the same completions; the reward model's scores, the rewards and the whole update
    (loss, gradient norm, entropy) must then agree to rounding, and the second step, generated by the updated policy,
    too."""
    args = (*TINY, f"reward.models=[{chat_reward_model}]", "reward.model_normalize=batch", "rollout.top_p=1e-9",
            "rollout.prompts_per_step=4", "trainer.steps=2")
    rows = {}
    for nproc in ("1", "2"):
        result = cli("train", "--nproc", nproc, *args, f"trainer.run_name=n{nproc}")
        assert result.returncode == 0, result.stderr
        rows[nproc] = read_metrics(tmp_path / "runs" / f"n{nproc}")
    compared = ("reward", "reward_model/", "response_length/", "batch/", "actor/pg_loss", "actor/grad_norm",
                "actor/entropy", "loss/global_num")
    for one, two in zip(rows["1"], rows["2"]):
        keys = {k for k in one if k.startswith(compared)}
        assert any(k.startswith("reward_model/0/raw/") for k in keys) and keys <= set(two)
        for key in sorted(keys):
            assert math.isclose(one[key], two[key], rel_tol=1e-4, abs_tol=1e-5), (one["step"], key, one[key], two[key])
