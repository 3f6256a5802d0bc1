"""Every YAML under conf/ composes and validates; the validation pass catches choices, ranges and cross-field rules."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fsdptrain.config.compose import PACKAGE_CONF_DIR, compose_config
from fsdptrain.config import SCHEMA_GROUPS, ConfigError, validate_world
from fsdptrain.config.docs import field_docs, render_configuration_md

REQUIRED_OVERRIDES = {
    ("model", "local"): ["model.path=/some/hf/folder"],
    ("data", "jsonl"): ["data.path=rollouts.jsonl", "rollout.max_new_tokens=32"],
    ("data", "prompts"): ["data.path=train.jsonl", "reward.functions=[exact_match]"],
    ("data", "sft"): ["data.path=chats.jsonl"],
    ("algorithm", "grpo"): [],
}


def _group_presets():
    for path in sorted(PACKAGE_CONF_DIR.glob("*/*.yaml")):
        yield path.parent.name, path.stem


def test_conf_symlink_points_at_packaged_configs():
    assert (Path(__file__).resolve().parents[2] / "conf").resolve() == PACKAGE_CONF_DIR


def test_default_config_composes():
    cfg = compose_config([])
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.use_critic
    assert cfg.loss.agg_mode == "token-mean"


@pytest.mark.parametrize(("group", "name"), list(_group_presets()))
def test_every_yaml_composes_and_validates(group, name):
    cfg = compose_config([f"{group}={name}", *REQUIRED_OVERRIDES.get((group, name), [])])
    assert cfg[group] is not None


@pytest.mark.parametrize("preset, message", [
    ("data=jsonl", "data.path"),
    ("data=sft", r"^data=sft \(fsdptrain sft, check-metrics data=sft\) needs data.path=<chats.jsonl"),
])
def test_preset_without_its_required_value_is_a_usage_error(preset, message):
    with pytest.raises(ConfigError, match=message):
        compose_config([preset])


def test_every_schema_field_has_a_docstring():
    docs = field_docs()
    for schema in SCHEMA_GROUPS.values():
        fields = {f.name for f in dataclasses.fields(schema)}
        assert fields == set(docs[schema.__name__]), schema.__name__
        assert all(docs[schema.__name__].values()), schema.__name__


def test_configuration_doc_matches_the_schema():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert doc == render_configuration_md(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.agg_mode=token_sum"], "loss.agg_mode='token_sum' is not a valid choice"),
        (["trainer.steps=0"], "trainer.steps=0 must be a positive integer"),
        (["algorithm.use_critic=false"], "algorithm.adv_estimator=gae needs a value model"),
        (["algorithm=grpo", "rollout.n=1"], "rollout.n=1 must be at least 2"),
        (["algorithm.clip_ratio_c=0.5"], "clip_ratio_c=0.5 must be a finite number > 1"),
        (["loss.loss_scale_factor=0"], "loss.loss_scale_factor=0.0 must be a finite number > 0"),
        (["parallel.dp_shard=two"], "parallel.dp_shard='two'"),
        (["trainer.mini_batches_per_step=3"], "must divide rollout.prompts_per_step=16"),
        (["rollout.gather_weights=yes"], "rollout.gather_weights='yes' is not a valid choice"),
        (["rollout.gather_weights_max_share=1.5"], "rollout.gather_weights_max_share=1.5 must be a number in (0, 1]"),
        (["algorithm.recompute_old_logprobs=never"], "algorithm.recompute_old_logprobs='never' is not a valid"),
        (["perf.peak_tflops=0"], "perf.peak_tflops=0.0 must be a finite number > 0"),
        (["parallel.compile_backend=cudagraphs"], "parallel.compile_backend='cudagraphs' is not a valid choice"),
        (["algorithm.rollout_correction=tis", "algorithm.rollout_correction_low=0.5"],
         "algorithm.rollout_correction_low=0.5 zeroes weights below it, which only rollout_correction=mis does"),
        (["algorithm.rollout_correction_low=0.5"], "(got 'none')"),
        (["algorithm.policy_loss=dro"], "algorithm.policy_loss=dro needs algorithm.dro_beta=<its penalty weight"),
        (["algorithm.policy_loss=dro", "algorithm.dro_beta=0"], "algorithm.dro_beta=0.0 must be a finite number > 0"),
        (["algorithm.rollout_correction=mis", "algorithm.rollout_correction_low=2"],
         "algorithm.rollout_correction_low=2.0 must be below algorithm.rollout_correction_cap=2.0"),
        (["algorithm.rollout_correction=mis", "algorithm.rollout_correction_low=0"],
         "algorithm.rollout_correction_low=0.0 must be a finite number > 0"),
        (["algorithm.rollout_rejection_divergence=seq_mean_k1"],
         "algorithm.rollout_rejection_divergence='seq_mean_k1' is not a valid choice"),
        (["algorithm.rollout_rejection_divergence=seq_mean_k3"],
         "algorithm.rollout_rejection_divergence=seq_mean_k3 needs algorithm.rollout_rejection_divergence_max="),
        (["algorithm.rollout_rejection_divergence_max=0.1"],
         "algorithm.rollout_rejection_divergence_max=0.1 bounds a divergence, but"),
        (["algorithm.rollout_rejection_divergence=token_k2", "algorithm.rollout_rejection_divergence_max=0"],
         "algorithm.rollout_rejection_divergence_max=0.0 must be a finite number > 0"),
    ],
)
def test_validation_names_the_bad_value(overrides, message):
    with pytest.raises(ConfigError) as excinfo:
        compose_config(overrides)
    assert message in str(excinfo.value)


def test_mesh_shape_from_world_size():
    cfg = compose_config([])
    assert validate_world(cfg, 4) == (1, 4)
    cfg = compose_config(["parallel.dp_replicate=2"])
    assert validate_world(cfg, 4) == (2, 2)
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        validate_world(cfg, 3)
    cfg = compose_config(["parallel.dp_replicate=2", "parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match="2 x 2 = 4 but the world size is 2"):
        validate_world(cfg, 2)


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["trainer.steps=5", "trainer.epochs=1"], "trainer.steps=5 and trainer.epochs=1.0 are both set: set one of them"),
    (["trainer.epochs=0"], "trainer.epochs=0.0 must be a finite number > 0"),
    (["data=jsonl", "data.path=r.jsonl", "rollout.max_new_tokens=8", "trainer.epochs=1"], "trainer.epochs needs"),
    (["data=prompts", "data.path=train.jsonl"], "data.source=prompts needs reward.functions"),
    (["logging.backends=[jsonl,neptune]"], "logging.backends: 'neptune' is not a valid choice"),
    (["data.long_prompts=truncate"], "data.long_prompts='truncate' is not a valid choice"),
])
def test_own_task_fields_are_checked(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        compose_config(overrides)


def test_steps_follow_epochs_over_the_training_rows():
    from fsdptrain.run.runner import resolve_steps

    assert resolve_steps(compose_config([]), 4096, rows_per_step=16) == 100  # neither set: the default
    assert resolve_steps(compose_config(["trainer.steps=7"]), 4096, rows_per_step=16) == 7
    # ceil(epochs x rows / rows_per_step): 0.3 x 100 / 10 = 3 exactly (not 4 from 30.000000000000004)
    assert resolve_steps(compose_config(["trainer.epochs=0.3"]), 100, rows_per_step=10) == 3
    assert resolve_steps(compose_config(["trainer.epochs=2"]), 30, rows_per_step=16) == 4  # 60/16


# ---- every numeric field of the schema, generated from it (a new field is covered without touching this file) ----

from fsdptrain.config.validate import declared_range, schema_fields  # noqa: E402


def test_every_number_field_declares_its_range():
    assert all(declared_range(key) is not None for key in schema_fields(float) + schema_fields(int))


@pytest.mark.parametrize("key", schema_fields(float))
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_every_float_field_refuses_non_finite(key, bad):
    with pytest.raises(ConfigError) as excinfo:
        compose_config([f"{key}={bad}"])
    assert str(excinfo.value).startswith(f"{key}=") and "\n" not in str(excinfo.value)


@pytest.mark.parametrize("key", schema_fields(float))
def test_every_float_field_refuses_values_outside_its_range(key):
    r = declared_range(key)
    low, low_in, high, high_in = r.low, r.low_in, r.high, r.high_in
    outside = [low - 1.0 if low_in else low] + ([high + 1.0 if high_in else high] if high != float("inf") else [])
    for value in outside:
        with pytest.raises(ConfigError, match=f"^{key}="):
            compose_config([f"{key}={value}"])


@pytest.mark.parametrize("key", schema_fields(int))
def test_every_int_field_refuses_negative_and_non_int(key):
    with pytest.raises(ConfigError, match=f"^{key}=-1 must be"):
        compose_config([f"{key}=-1"])
    with pytest.raises(ConfigError, match=key):
        compose_config([f"{key}=1.5"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.lr=inf"], "trainer.lr=inf must be a finite number > 0"),
    (["trainer.grad_clip=nan"], "trainer.grad_clip=nan must be a finite number >= 0"),
    (["algorithm.clip_ratio_c=nan"], "algorithm.clip_ratio_c=nan"),
    (["algorithm.lam=-5"], "algorithm.lam=-5.0 must be a number in [0, 1]"),
    (["algorithm.clip_ratio_low=inf"], "algorithm.clip_ratio_low=inf must be a number in (0, 1]"),
    (["algorithm.gamma=nan"], "algorithm.gamma=nan must be a number in [0, 1]"),
    (["model=local"], "model=local needs model.path="),
    (["trainer.overwrite=true", "trainer.resume=auto"], "choose one"),
])
def test_issue_14_values_are_refused(overrides, message):
    with pytest.raises(ConfigError) as excinfo:
        compose_config(overrides)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(("override", "message"), [
    ("data.eval_size=4", "data.eval_size was renamed: set data.num_eval_prompts instead"),
    ("+data.eval_size=4", "data.eval_size was renamed: set data.num_eval_prompts instead"),
    ("data.max_response_length=8", "data.max_response_length was renamed: set rollout.max_new_tokens instead"),
])
def test_a_renamed_key_names_its_new_key(override, message):
    with pytest.raises(ConfigError) as excinfo:
        compose_config([override])
    assert str(excinfo.value) == message


def test_offline_rollouts_declare_their_maximum_response_length():
    with pytest.raises(ConfigError, match=r"^data=jsonl needs rollout.max_new_tokens="):
        compose_config(["data=jsonl", "data.path=r.jsonl"])
    assert compose_config(["data=jsonl", "data.path=r.jsonl", "rollout.max_new_tokens=9"]).rollout.max_new_tokens == 9


def _preset_values(path: Path) -> dict[str, object]:
    """``{dotted key: value}`` a preset YAML sets (its package: its group, or the root for `# @package _global_`)."""
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not path.read_text().startswith("# @package _global_"):
        node = {path.parent.name: node or {}}
    return {f"{group}.{key}": value for group, fields in node.items() for key, value in fields.items()}


@pytest.mark.parametrize(("group", "name"), list(_group_presets()))
def test_presets_hold_only_what_differs_from_the_defaults(group, name):
    from fsdptrain.config import Config

    defaults = Config()
    for key, value in _preset_values(PACKAGE_CONF_DIR / group / f"{name}.yaml").items():
        section, field = key.split(".")
        assert value != getattr(getattr(defaults, section), field), f"{group}/{name}.yaml restates {key}={value}"


@pytest.mark.parametrize(("overrides", "setting"), [
    (["data=jsonl", "data.path=x.jsonl", "rollout.max_new_tokens=8"], "data.source=jsonl"),
    (["rollout.agent=agent.py:run"], "rollout.agent"),
    (["rollout.engine=generate", "rollout.tools=[tools.py:add]"], "rollout.engine=generate with tools"),
    (["trainer.share_prompts=true"], "trainer.share_prompts=true"),
    (["drafter.enabled=true"], "drafter.enabled=true"),
])
def test_routing_replay_refuses_what_carries_or_replays_no_routes_in_one_line(overrides, setting):
    with pytest.raises(ConfigError) as excinfo:
        compose_config(["model.moe.routing_replay=true", *overrides])
    message = str(excinfo.value)
    assert message.startswith(f"model.moe.routing_replay=true is not supported with {setting} (")
    assert "\n" not in message


def test_routing_replay_composes_with_the_separate_placement():
    cfg = compose_config(["model.moe.routing_replay=true", "rollout.placement=separate", "rollout.max_staleness=1"])
    assert cfg.model.moe.routing_replay and cfg.rollout.placement == "separate"
