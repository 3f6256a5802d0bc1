"""Every recipe-specific refusal holds on the config-file route too (issue 56, class 4): a setting that does not apply
to ``fsdptrain sft`` (or to a command's data source, or to distillation) written in the user's own YAML
(``--config-dir``/``--config-name``) is refused by the rules of the composed config, exactly as the same override is.
Composed here through hydra's compose API as the CLI does (`fsdptrain/config/compose.py`), no subprocess."""

from __future__ import annotations

import pytest

from fsdptrain.cli import _sft_overrides
from fsdptrain.config import ConfigError
from fsdptrain.config.compose import compose_config
from fsdptrain.preflight import check_command_source

SFT = "data:\n  path: chats.jsonl\n"
CASES = {  # case: (command, the user's YAML after the defaults, what the one line names)
    "sft: an algorithm preset": ("sft", "defaults:\n  - config\n  - override algorithm: grpo\n  - _self_\n" + SFT,
                                 "algorithm.name='grpo' does not apply to fsdptrain sft"),
    "sft: an algorithm setting": ("sft", SFT + "algorithm:\n  gamma: 0.5\n", "algorithm.gamma=0.5 does not apply"),
    "sft: an algorithm plugin": ("sft", SFT + "algorithm:\n  plugins: [json]\n", "algorithm.plugins=['json'] does"),
    "sft: a teacher": ("sft", SFT + "algorithm:\n  distill:\n    teacher: t\n",
                       "algorithm.distill.teacher='t' does not apply to fsdptrain sft"),
    "sft: a rollout setting": ("sft", SFT + "rollout:\n  n: 8\n", "rollout.n=8 does not apply to fsdptrain sft"),
    "sft: a reward setting": ("sft", SFT + "reward:\n  functions: [exact_match]\n",
                              "reward.functions=['exact_match'] does not apply to fsdptrain sft"),
    "sft: the drafter": ("sft", SFT + "drafter:\n  enabled: true\n", "drafter.enabled=True does not apply"),
    "sft: context parallelism": ("sft", SFT + "parallel:\n  cp: 2\n", "parallel.cp=2 does not apply"),
    "sft: mini-batches": ("sft", SFT + "sft:\n  rows_per_step: 6\ntrainer:\n  mini_batches_per_step: 4\n",
                          "trainer.mini_batches_per_step=4 must divide sft.rows_per_step=6"),
    "sft: another data source": ("sft", SFT + "  source: task\n",
                                 "fsdptrain sft reads demonstrations: data.source=task"),
    "train: demonstrations": ("train", "defaults:\n  - config\n  - override data: sft\n  - _self_\n" + SFT,
                              "data.source=sft (demonstrations) is for fsdptrain sft, not fsdptrain train"),
    "check-reward: demonstrations": ("check-reward", "defaults:\n  - config\n  - override data: sft\n  - _self_\n" + SFT,
                                     "data.source=sft (demonstrations) is for fsdptrain sft, not fsdptrain check"),
    "distill: task_reward without a teacher": ("train", "algorithm:\n  distill:\n    task_reward: add\n",
                                               "algorithm.distill.task_reward=add needs a teacher"),
    "distill: a teacher with a critic": ("train", "algorithm:\n  distill:\n    teacher: t\n",
                                         "on-policy distillation's advantage is the per-token reverse KL"),
}


def _compose(command: str, folder) -> None:
    overrides = _sft_overrides([]) if command == "sft" else []
    cfg = compose_config(overrides, config_dir=str(folder), config_name="mine")
    check_command_source(command, cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_a_refusal_holds_when_the_setting_comes_from_a_config_file(tmp_path, case):
    command, text, culprit = CASES[case]
    if not text.startswith("defaults:"):
        text = "defaults:\n  - config\n  - _self_\n" + text
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        _compose(command, tmp_path)
    assert culprit in str(err.value)


@pytest.mark.parametrize("override", ["algorithm=grpo", "algorithm.gamma=0.5", "rollout.n=8"])
def test_the_same_setting_on_the_command_line_is_refused_the_same(override):
    with pytest.raises(ConfigError, match="does not apply to fsdptrain sft"):
        compose_config(_sft_overrides([override, "data.path=chats.jsonl"]))


def test_an_moe_model_refuses_context_parallelism_and_the_drafter_in_one_line(tmp_path):
    """fsdptrain/preflight.py check_moe_settings: what an MoE policy does not run with (docs/moe.md)."""
    from fsdptrain.preflight import check_moe_settings
    from tests.helpers.tiny_moe import write_tiny_moe

    folder = write_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    base = ["model=local", f"model.path={folder}", "algorithm=grpo"]
    check_moe_settings(compose_config(base))  # GRPO on it is fine
    for extra, words in ((["parallel.cp=2"], "parallel.cp=2 is not supported with mixture-of-experts models yet: "
                                             "set parallel.cp=1"),
                         (["drafter.enabled=true"], "drafter.enabled=true is not supported with mixture-of-experts "
                                                    "models yet: set drafter.enabled=false")):
        with pytest.raises(ConfigError, match=words):
            check_moe_settings(compose_config(base + extra))
