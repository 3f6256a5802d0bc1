"""Routing replay end to end (docs/moe.md, "Routing replay"): the real CLI trains a tiny Qwen3-MoE whose routers
nearly tie (tests/helpers/tiny_moe.py, ``router_spread=1e-7``), so the generating forward (a padded batch with a KV
cache) and the training forward (a packed row) choose different experts for some tokens on the same weights.

Without replay the first step's log-prob gap (``rollout/logprob_diff/max``, training forward against the generating
forward at the sampled tokens, step 0: the same weights) is that of other experts: ~1e-3 measured. With
``model.moe.routing_replay=true`` the training forward runs the generation's experts and the gap is float32 rounding:
~2e-7 to 5e-7 measured, asserted under 1e-6. Both from the first update forward (the old log-prob pass is skipped,
the default) and from the old log-prob pass on 2 ranks. ``moe/topk_differ/tokens`` (the routers' own top-k against the
recorded, before any replay) shows the near-ties either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import metric_kinds
from tests.helpers.tiny_moe import save_tiny_moe

RUN = ("algorithm=grpo", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=16",
       "trainer.eval_every=0", "logging.progress=false", "trainer.steps=1")


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("moe") / "model", router_spread=1e-7)


def _first_row(cli, tmp_path: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    run_dir = tmp_path / name
    proc = cli("train", *RUN, *overrides, f"trainer.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0]), run_dir


def test_replay_closes_the_generation_gap_on_near_ties(cli, tmp_path, near_ties):
    model = f"model.path={near_ties}"
    without, _ = _first_row(cli, tmp_path, "without", model)
    replayed, run_dir = _first_row(cli, tmp_path, "replayed", model, "model.moe.routing_replay=true")
    assert without["moe/topk_differ/tokens"] > 0.05 and replayed["moe/topk_differ/tokens"] > 0.05
    assert without["rollout/logprob_diff/max"] > 1e-4  # other experts: not rounding
    assert replayed["rollout/logprob_diff/max"] < 1e-6  # float32 rounding only
    assert replayed["rollout/logprob_diff/mean"] < 1e-7
    kinds = metric_kinds(run_dir)
    assert kinds["moe/topk_differ/tokens"] == kinds["moe/topk_differ/layer_tokens"] == "mean"


def test_the_old_logprob_pass_replays_on_two_ranks(cli, tmp_path, near_ties):
    row, _ = _first_row(cli, tmp_path, "two", f"model.path={near_ties}", "model.moe.routing_replay=true",
                        "algorithm.recompute_old_logprobs=always", "--nproc", "2")
    assert row["rollout/logprob_diff/max"] < 1e-6 and row["moe/topk_differ/tokens"] > 0.05
    assert row["actor/on_policy_max_ratio_dev"] < 1e-6  # the update forward replays what the pass replayed


def test_a_generator_rank_sends_the_routes_it_sampled_and_the_trainer_replays_them(cli, tmp_path, near_ties):
    """``rollout.placement=separate`` (one trainer rank, one generator rank, k=0): the generator records the routes
    of its own forwards and they travel with the samples; the trainer's forward replays them within float32
    rounding of the generator's log-probs."""
    row, _ = _first_row(cli, tmp_path, "separate", f"model.path={near_ties}", "model.moe.routing_replay=true",
                        "rollout.placement=separate", "--nproc", "2")
    assert row["moe/topk_differ/tokens"] > 0.05  # the trainer's routers alone would route elsewhere
    assert row["rollout/logprob_diff/max"] < 1e-6


def test_a_dense_policy_with_replay_is_one_line_and_exit_2(cli, tmp_path):
    proc = cli("train", "model.moe.routing_replay=true", "trainer.steps=1", f"trainer.run_dir={tmp_path / 'd'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.moe.routing_replay=true needs a mixture")


def test_multi_turn_tool_calls_replay_on_the_continuous_engine(tmp_path):
    """The tool-calling task of tests/e2e/test_multi_turn.py on a tiny Qwen3-MoE (its embedding and head tilted the
    same way, so it calls tools from the first step; its routers blind to that tilt, so tokens route to different
    experts): each turn's routes come from its prefill onto the kept cache, the tool's tokens included. The
    trajectories' records line up with their tokens (the training routers pick the recorded experts: a record
    shifted by a token would not), and the replayed training forward scores every sampled token of every turn
    within float32 rounding."""
    import torch

    from fsdptrain.model.moe import moe_layers
    from tests.conftest import run_cli
    from tests.e2e.test_multi_turn import ADD_CALL, INCREMENT_CALL, TOOL, common, write_inputs
    from tests.helpers.chatml_tokenizer import chatml_tokenizer
    from tests.helpers.tiny_moe import tiny_moe

    write_inputs(tmp_path)  # prompts, tools, rewards (and a dense model, replaced here)
    tokenizer = chatml_tokenizer(extra_tokens=(ADD_CALL, INCREMENT_CALL))
    model = tiny_moe(tokenizer=tokenizer, tie_word_embeddings=False, max_position_embeddings=1024)
    with torch.no_grad():  # as tests/e2e/test_multi_turn.py's model: the call tokens and EOS about 14% each
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[[2, len(tokenizer) - 2, len(tokenizer) - 1], 0] = 0.57
        for layer in moe_layers(model):
            layer.router.weight[:, 0] = 0.0
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    proc = run_cli("train", *common(tmp_path), *TOOL, "trainer.steps=1", "model.moe.routing_replay=true",
                   f"trainer.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["turns/max"] >= 2 and row["tools/call_frequency"] > 0
    assert row["moe/topk_differ/tokens"] < 0.01
    assert row["rollout/logprob_diff/max"] < 1e-6, row["rollout/logprob_diff/max"]
