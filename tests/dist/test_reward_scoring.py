"""The experience path's reward-model scoring: 2 gloo ranks == one process (workers/reward_scoring_checks.py).

Same per-sample totals, the same running moments after each step and the same reduced metrics, for two reward models
with different tokenizers, running normalisation, a clip and weights; the moments and the combination are also
worked out here from the raw scores, independently of fsdptrain/rl/reward_scale.py.
"""

from __future__ import annotations

import math

import pytest

from tests.dist.launch import launch, run_single
from tests.helpers.reward_model_folders import CHAT_TEMPLATE, char_tokenizer, save_reward_model

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    models = tmp_path_factory.mktemp("reward_models")
    save_reward_model(models / "chat", arch="llama", tokenizer=char_tokenizer(CHAT_TEMPLATE), seed=5)
    save_reward_model(models / "qwen2", arch="qwen2", seed=6)
    out = {}
    for nproc in (1, 2):
        folder = tmp_path_factory.mktemp(f"out{nproc}")
        if nproc == 1:
            result = run_single("reward_scoring_checks.py", out_dir=folder, args=("--models", str(models)))
        else:
            result = launch("reward_scoring_checks.py", nproc=2, out_dir=folder, args=("--models", str(models)))
        out[nproc] = result.checked(nproc).results
    return out


def close(a, b, tol=TOL) -> bool:
    return all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b, strict=True))


def test_two_ranks_score_and_normalise_like_one_process(runs):
    one = runs[1][0]["steps"]
    for rank in (0, 1):
        two = runs[2][rank]["steps"]
        for a, b in zip(one, two):
            assert close(a["total"], b["total"]), (rank, a["total"], b["total"])
            for m in range(2):
                assert close(a["raw"][m], b["raw"][m])
                assert close(a["running"][m].values(), b["running"][m].values())
            assert a["metrics"].keys() == b["metrics"].keys()
            assert close([a["metrics"][k] for k in sorted(a["metrics"])], [b["metrics"][k] for k in sorted(a["metrics"])])


def test_running_moments_clip_and_weights_by_hand(runs):
    steps = runs[2][0]["steps"]
    seen = [[], []]
    for step in steps:
        scaled = []
        for m in range(2):
            seen[m] += step["raw"][m]
            mean = sum(seen[m]) / len(seen[m])
            var = sum((x - mean) ** 2 for x in seen[m]) / (len(seen[m]) - 1)
            assert math.isclose(step["running"][m]["mean"], mean, abs_tol=1e-9)
            assert math.isclose(step["running"][m]["count"], len(seen[m]))
            scaled.append([max(-1.5, min(1.5, (x - mean) / math.sqrt(var + 1e-8))) for x in step["raw"][m]])
            metrics = step["metrics"]
            assert math.isclose(metrics[f"reward_model/{m}/raw/mean"], sum(step["raw"][m]) / 6, abs_tol=1e-9)
            assert math.isclose(metrics[f"reward_model/{m}/scaled/max"], max(scaled[m]), abs_tol=1e-6)
        assert close(step["total"], [a + 0.5 * b for a, b in zip(*scaled)], tol=1e-6)
