"""`fsdptrain train` end to end as a user runs it: it learns, both presets run, offline data and a user's HF folder."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

QUIET = ["logging.progress=false"]
TINY = ["trainer.steps=2", "rollout.prompts_per_step=4", "rollout.n=2", "trainer.eval_every=0", *QUIET]
# The default itself, without the periodic greedy evaluation (about 30 s on a free 2-core machine).
LEARN = ["trainer.eval_every=0", *QUIET]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _gain(rows: list[dict]) -> float:
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    return last - first


def test_default_ppo_learns(cli, tmp_path):
    result = cli("train", *LEARN, "trainer.run_name=learn")
    assert result.returncode == 0, result.stderr
    rows = _metrics(tmp_path / "runs" / "learn")
    assert len(rows) == 100
    assert _gain(rows) >= 0.15, [round(r["reward/mean"], 3) for r in rows]
    assert all(r["actor/on_policy_max_ratio_dev"] < 1e-6 for r in rows)
    assert {"critic/vf_loss", "critic/values_min", "critic/values_max", "actor/pg_loss"} <= set(rows[-1])
    assert "token-mean: the loss is the mean over all" in result.stdout
    assert "fsdptrain summary" in result.stdout


@pytest.mark.slow  # 100 steps on 2 ranks; that 2 ranks step as 1 process is proven exactly in tests/dist and check-metrics
def test_default_ppo_learns_on_two_ranks(cli, tmp_path):
    result = cli("train", "--nproc", "2", *LEARN, "trainer.run_name=learn2")
    assert result.returncode == 0, result.stderr
    rows = _metrics(tmp_path / "runs" / "learn2")
    assert _gain(rows) >= 0.15, [round(r["reward/mean"], 3) for r in rows]
    assert rows[0]["batch/num_seqs"] == 64  # the global batch, counted over both ranks


def test_grpo_preset_runs_without_a_critic(cli, tmp_path):
    result = cli("train", "algorithm=grpo", *TINY, "trainer.run_name=grpo")
    assert result.returncode == 0, result.stderr
    rows = _metrics(tmp_path / "runs" / "grpo")
    assert len(rows) == 2
    assert not any(key.startswith("critic/") for key in rows[-1])
    assert (tmp_path / "runs" / "grpo" / "export" / "policy" / "model.safetensors").exists()
    assert not (tmp_path / "runs" / "grpo" / "export" / "critic").exists()


def test_metric_kinds_json_gives_every_logged_number_its_kind(cli, tmp_path):
    """metric_kinds.json types every number of metrics.jsonl; every perf/* number is DIAGNOSTIC, so a comparison that
    skips by kind skips it (and would not skip a non-diagnostic metric that happened to be named perf/...). The
    last step evaluates with 2 samples per prompt (docs/evaluation.md): its greedy and sampled numbers are MEANs."""
    evaluation = ("trainer.eval_every=2", "data.num_eval_prompts=2", "trainer.eval_n=2", "trainer.eval_k=[1,2]")
    result = cli("train", *TINY, *evaluation, "trainer.run_name=kinds")
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "kinds"
    kinds = json.loads((run_dir / "metric_kinds.json").read_text())
    logged = {key for row in _metrics(run_dir) for key in row} - {"step"}
    assert set(kinds) == logged
    perf = {key for key in logged if key.startswith("perf/")}
    assert {"perf/step_s", "perf/update_s", "perf/tokens_per_s", "perf/peak_mem_gib"} <= perf
    assert {kinds[key] for key in perf} == {"diagnostic"}, {k: kinds[k] for k in perf}
    first = _metrics(run_dir)[0]
    assert first["perf/generate_s"] > 0 and first["perf/reward_s"] > 0  # the phases are timed where they run
    assert "mean step time" in result.stdout and "generated tokens/s" in result.stdout  # the summary reads them
    assert (kinds["actor/pg_loss"], kinds["critic/values_min"], kinds["batch/num_seqs"]) == ("loss", "min", "sum")
    assert (kinds["actor/fill_efficiency"], kinds["actor/lr"]) == ("diagnostic", "max")
    assert (kinds["actor/grad_norm"], kinds["train/nonfinite_skipped"]) == ("mean", "max")
    assert set(kinds.values()) <= {"sum", "mean", "min", "max", "loss", "derived", "diagnostic"}  # no untyped fact
    rows = _metrics(run_dir)
    sampled = ("eval/pass@1", "eval/pass@2", "eval/mean@2", "eval/maj@2")
    assert not any(key.startswith("eval/") for key in rows[0])  # step 1 of 2 does not evaluate
    assert {key for key in rows[1] if key.startswith("eval/")} == {"eval/reward", *sampled}
    assert {kinds[key] for key in ("eval/reward", *sampled)} == {"mean"}
    assert 0 <= rows[1]["eval/pass@1"] <= rows[1]["eval/pass@2"] <= 1


def _write_rollouts(path: Path, bad_line: str | None = None, behaviour_groups: int = 0) -> None:
    """4 groups of 2; the first ``behaviour_groups`` carry behaviour log-probs of 0 (probability 1) per token."""
    rows = []
    for group, digit in enumerate("3719"):
        for response, reward in ((f"{digit} {digit} {digit}", 1.0), (f"{digit} 0", 1 / 3)):
            row = {"prompt": f"repeat {digit} =", "response": response, "reward": reward, "group": group}
            if group < behaviour_groups:
                row["behaviour_logprobs"] = [0.0] * (len(response.split()) + 1)  # the words and EOS
            rows.append(json.dumps(row))
    if bad_line is not None:
        rows.insert(2, bad_line)
    path.write_text("\n".join(rows) + "\n")


def test_offline_jsonl_rollouts_train(cli, tmp_path):
    data = tmp_path / "rollouts.jsonl"
    _write_rollouts(data, behaviour_groups=2)
    result = cli("train", "data=jsonl", f"data.path={data}", "rollout.max_new_tokens=8", "algorithm=grpo",
                 *TINY, "trainer.run_name=offline")
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "offline"
    rows = _metrics(run_dir)
    assert rows[0]["batch/num_seqs"] == 8  # 4 groups of 2 per step
    # by hand from the file: each group holds "d d d" (reward 1, 3 words + EOS) and "d 0" (reward 1/3, 2 + EOS)
    assert rows[0]["reward/mean"] == pytest.approx(2 / 3, abs=1e-6)
    assert rows[0]["response_length/mean"] == pytest.approx(3.5, abs=1e-6)
    assert rows[0]["response_length/max"] == 4
    # groups 0 and 1 carry behaviour log-probs 0: d = 0 - old > 0 and every ratio exp(old) < 1/2 (the untrained
    # model spreads its probability), so all of their 14 tokens leave [1/2, 2]; groups 2 and 3 are left out
    kinds = json.loads((run_dir / "metric_kinds.json").read_text())
    for row in rows:
        assert row["rollout_corr/ratio_outside_frac"] == 1.0
        assert row["rollout_corr/kl_k1"] > 0 and row["rollout_corr/kl_k3"] > 0 and row["rollout_corr/log_ppl_diff"] > 0
    assert {kinds[f"rollout_corr/{name}"] for name in ("kl_k1", "kl_k3", "log_ppl_diff", "ratio_outside_frac")} == {
        "mean"}


def test_bad_jsonl_row_exits_2_naming_file_and_line(cli, tmp_path):
    data = tmp_path / "rollouts.jsonl"
    _write_rollouts(data, bad_line='{"prompt": "repeat 1 =", "response": "1"}')
    result = cli("train", "data=jsonl", f"data.path={data}", "rollout.max_new_tokens=8", "algorithm=grpo", *TINY)
    assert result.returncode == 2, result.stderr
    assert f"{data}:3:" in result.stderr
    assert "Traceback" not in result.stderr


def test_users_hf_folder_trains_two_steps(cli, tmp_path):
    from fsdptrain.data.tokenizer import load_bundled_tokenizer
    from tests.helpers.tiny_llama import tiny_llama

    tokenizer = load_bundled_tokenizer()
    folder = tmp_path / "my-model"
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    result = cli("train", "model=local", f"model.path={folder}", *TINY, "trainer.run_name=hf")
    assert result.returncode == 0, result.stderr
    assert len(_metrics(tmp_path / "runs" / "hf")) == 2


def test_stale_old_logprobs_raise_the_on_policy_guard(cli, tmp_path):
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "sitecustomize.py").write_text(textwrap.dedent("""\
        import fsdptrain.train.experience as experience

        _original = experience.routed_policy_logprobs  # the old log-prob pass (its routes: MoE policies)

        def _stale(*args, **kwargs):
            old, metrics = _original(*args, **kwargs)
            return [lp - 0.1 for lp in old], metrics

        experience.routed_policy_logprobs = _stale
        """))
    env = {"PYTHONPATH": os.pathsep.join([str(patch_dir), os.environ.get("PYTHONPATH", "")])}
    # the guard watches the recomputed old log-probs; `auto` skips that pass on a strictly on-policy step
    result = cli("train", *TINY, "algorithm.recompute_old_logprobs=always", "trainer.run_name=stale", env=env)
    assert result.returncode == 0, result.stderr
    rows = _metrics(tmp_path / "runs" / "stale")
    # old log-probs 0.1 lower than the policy's: the first ratio is exp(0.1) on every token
    assert rows[0]["actor/on_policy_max_ratio_dev"] == pytest.approx(0.10517, abs=1e-4)


def test_tensorboard_backend_writes_events_or_names_the_missing_package(cli, tmp_path):
    result = cli("train", *TINY, "logging.backends=[jsonl,tensorboard]", "trainer.run_name=tb")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == ("error: logging.backends: tensorboard needs the tensorboard package: pip install "
                                         "fsdptrain[tensorboard] (or drop tensorboard from logging.backends)")
        assert not (tmp_path / "runs").exists()
    else:
        assert result.returncode == 0, result.stderr
        assert list((tmp_path / "runs" / "tb" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow  # CI time; the optional logging backends
def test_wandb_and_mlflow_backends_log_offline(cli, tmp_path):
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}", "WANDB_SILENT": "true"}
    result = cli("train", *TINY, "logging.backends=[jsonl,wandb,mlflow]", "trainer.run_name=trk", env=env)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "runs" / "trk" / "wandb").glob("offline-run-*"))
    metric_files = list((tmp_path / "mlruns").glob("*/*/metrics/reward/mean"))
    assert len(metric_files) == 1
    assert [line.split()[2] for line in metric_files[0].read_text().splitlines()] == ["0", "1"]  # the steps


def test_token_budget_below_a_sequence_is_a_usage_error(cli, tmp_path):
    result = cli("train", *TINY, "trainer.token_budget=5")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: trainer.token_budget=5 is smaller than a sequence of 10 tokens this run can make (its "
                     "longest prompt, 4 tokens, + rollout.max_new_tokens=6): raise trainer.token_budget to at least 10"]
    assert not (tmp_path / "runs").exists()  # checked before the run folder is claimed
