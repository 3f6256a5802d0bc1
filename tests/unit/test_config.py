"""Every YAML under conf/ composes and validates; the validation pass catches choices, ranges and cross-field rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fsdptrain.compose import PACKAGE_CONF_DIR, compose_config
from fsdptrain.config import SCHEMA_GROUPS, ConfigError, validate_world
from fsdptrain.config.docs import field_docs, render_configuration_md

REQUIRED_OVERRIDES = {
    ("model", "local"): ["model.path=/some/hf/folder"],
    ("data", "jsonl"): ["data.path=rollouts.jsonl", "data.max_response_length=32"],
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


def test_preset_without_its_required_value_is_a_usage_error():
    with pytest.raises(ConfigError, match="data.path"):
        compose_config(["data=jsonl"])


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
        (["algorithm.clip_ratio_c=0.5"], "clip_ratio_c=0.5 must be > 1"),
        (["loss.loss_scale_factor=0"], "loss.loss_scale_factor=0.0 must be > 0"),
        (["parallel.dp_shard=two"], "parallel.dp_shard='two'"),
        (["trainer.mini_batches_per_step=3"], "must divide rollout.prompts_per_step=16"),
        (["rollout.gather_weights=yes"], "rollout.gather_weights='yes' is not a valid choice"),
        (["rollout.gather_weights_max_share=1.5"], "rollout.gather_weights_max_share=1.5 must be in (0, 1]"),
        (["algorithm.recompute_old_logprobs=never"], "algorithm.recompute_old_logprobs='never' is not a valid"),
        (["perf.peak_tflops=0"], "perf.peak_tflops=0.0 must be > 0 or null"),
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
