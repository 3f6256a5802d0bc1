"""A user's own advantage estimator and policy loss, written to files, train through the CLI; a function that does not
fit is one line and exit 2."""

from __future__ import annotations

import json
import textwrap

ESTIMATOR = textwrap.dedent("""\
    import torch
    from fsdptrain.rl.estimator_registry import AdvantageResult

    def centred(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
        # each sequence's score minus the batch's mean score, on every response token; whitened globally
        adv_N = scores_N - scores_N.mean()
        return AdvantageResult(torch.where(mask_BT, adv_N[:, None], 0.0), None, True)

    def wrong_shape(*, token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
        return AdvantageResult(scores_N, None, False)

    def wrong_signature(rewards, mask):
        return None
    """)

LOSS = textwrap.dedent("""\
    import torch
    from fsdptrain.metrics.typed import Mean, Metrics

    def reinforce(logprobs, old_logprobs, advantages, valid, *, layout, settings):
        # plain REINFORCE: -A logp per token
        return -advantages * logprobs, Metrics({"user_logp": Mean.of(logprobs.detach(), valid)})
    """)


def _files(tmp_path):
    (tmp_path / "est.py").write_text(ESTIMATOR)
    (tmp_path / "loss.py").write_text(LOSS)


def test_user_estimator_and_loss_train_two_steps(cli, tmp_path):
    _files(tmp_path)
    result = cli("train", "algorithm=grpo", "algorithm.adv_estimator=est.py:centred",
                 "algorithm.policy_loss=loss.py:reinforce", "trainer.steps=2", "trainer.run_dir=run",
                 "trainer.eval_every=0", "logging.progress=false", env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert all("actor/user_logp" in line and line["actor/grad_norm"] > 0 for line in lines)


def test_a_function_that_does_not_fit_is_exit_2(cli, tmp_path):
    _files(tmp_path)
    bad = cli("train", "algorithm=grpo", "algorithm.adv_estimator=est.py:wrong_signature")
    assert bad.returncode == 2 and "must accept" in bad.stderr and "Traceback" not in bad.stderr
    missing = cli("train", "algorithm.policy_loss=loss.py:nope")
    assert missing.returncode == 2 and "no attribute 'nope'" in missing.stderr
    shaped = cli("train", "algorithm=grpo", "algorithm.adv_estimator=est.py:wrong_shape", "trainer.steps=1",
                 "trainer.eval_every=0", "logging.progress=false", env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert shaped.returncode == 2, shaped.stdout + shaped.stderr
    assert "returned advantages_BT of shape" in shaped.stderr and "Traceback" not in shaped.stderr


PLUGIN = textwrap.dedent("""\
    import fsdptrain
    from fsdptrain.metrics.typed import Mean, Metrics

    @fsdptrain.register_policy_loss("my_reinforce")
    def reinforce(logprobs, old_logprobs, advantages, valid, *, layout, settings):
        return -advantages * logprobs, Metrics({"plugin_logp": Mean.of(logprobs.detach(), valid)})
    """)


def test_a_plugin_registers_a_policy_loss_by_name(cli, tmp_path):
    (tmp_path / "mine.py").write_text(PLUGIN)
    result = cli("train", "algorithm=grpo", "algorithm.plugins=[mine.py]", "algorithm.policy_loss=my_reinforce",
                 "trainer.steps=1", "trainer.run_dir=run", "trainer.eval_every=0", "logging.progress=false",
                 env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "actor/plugin_logp" in line and line["actor/grad_norm"] > 0
    unknown = cli("train", "algorithm.policy_loss=my_reinforce")  # without the plugin the name is unknown
    assert unknown.returncode == 2 and "'my_reinforce' is not a valid choice" in unknown.stderr
