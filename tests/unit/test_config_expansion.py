"""Bounds on config expansion (fsdptrain/config/expansion.py): sizes counted by hand on small files and configs."""

from __future__ import annotations

import json
import os

import pytest

from fsdptrain.config.expansion import (
    MAX_VALUE_CHARS,
    check_interpolations,
    check_yaml_files,
    interpolation_sizes,
    yaml_expansion,
)


def test_yaml_expansion_counts_every_alias_as_its_whole_node(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("a: &a [1, 2]\nb: [*a, *a]\n")
    # root 1 + keys a, b 2 + a's list 1 + 2 + b's list 1 + 2 x 3 = 13
    assert yaml_expansion(path) == 13
    path.write_text("a: [1, 2]\nb: [[1, 2], [1, 2]]\n")
    assert yaml_expansion(path) == 13  # the same values written out count the same


def test_yaml_expansion_of_nine_levels_of_nine_is_counted_without_expanding(tmp_path):
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "lol.yaml").write_text("\n".join(lines) + "\n")
    (tmp_path / "ok.yaml").write_text("trainer:\n  steps: 1\n")
    count = yaml_expansion(tmp_path / "sub" / "lol.yaml")
    assert count == 1 + 9 + sum(sum(9 ** k for k in range(i + 2)) for i in range(9))  # root, keys, each level
    problem = check_yaml_files(tmp_path)
    assert problem is not None and problem.startswith(f"{tmp_path}/sub/lol.yaml: its YAML aliases expand to {count}")
    assert check_yaml_files(tmp_path / "sub" / "..") is not None and yaml_expansion(tmp_path / "ok.yaml") == 5


def test_interpolation_sizes_follow_absolute_relative_and_selected_references():
    raw = {"x": "ab", "y": "${x}${x}c", "z": {"w": "${..y}", "v": "${.w}!", "s": "${oc.select:x,none}"},
           "e": "${oc.env:HOME}", "n": 12}
    sizes = interpolation_sizes(raw)
    assert sizes["x"] == 2 and sizes["y"] == 5 and sizes["z.w"] == 5 and sizes["z.v"] == 6
    assert sizes["z.s"] == 2 + len("none")  # the selected value or the default
    assert sizes["e"] == len(os.environ.get("HOME", "")) and sizes["n"] == 2
    assert sizes["z"] == 2 + (1 + 4 + 5) + (1 + 4 + 6) + (1 + 4 + 6)  # braces, each key, quotes and separators


def test_exponential_and_recursive_interpolations_are_refused_with_their_key():
    raw = {"a0": "x" * 10}
    for i in range(1, 8):
        raw[f"a{i}"] = f"${{a{i - 1}}}" * 10
    assert interpolation_sizes(raw)["a7"] == 10 ** 8
    assert check_interpolations(raw) == (f"a7: its interpolations (${{...}}) expand to about {10 ** 8} characters, "
                                         f"more than {MAX_VALUE_CHARS} (a config built to expand without bound): fix "
                                         "the value")
    assert check_interpolations({"g": {"a": "${g.b}", "b": "${g.a}"}}).startswith("g.a: its interpolations (${...}) "
                                                                                   "refer back to themselves")
    assert check_interpolations({"a": "${b}", "b": "c" * 100}) is None


HEAD = "defaults:\n  - config\n  - _self_\n"
UNBUILDABLE = {  # a shape of the user's config file: what the one line says (issue 56, class 2)
    "deep list": (HEAD + "algorithm:\n  plugins: " + "[" * 3000 + "]" * 3000 + "\n", "nest deeper than"),
    "deep mapping": (HEAD + "trainer:\n  x: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nest deeper than"),
    "nesting past the bound": (HEAD + "algorithm:\n  plugins: " + "[" * 40 + "]" * 40 + "\n", "nest deeper than"),
    "recursive alias in a list": (HEAD + "algorithm:\n  plugins: &a [*a]\n", "contains itself"),
    "recursive alias in a mapping": (HEAD + "trainer: &t\n  x: *t\n", "contains itself"),
    "binary": (HEAD + "trainer:\n  run_name: !!binary aGVsbG8=\n", "'tag:yaml.org,2002:binary'"),
    "timestamp tag": (HEAD + "trainer:\n  run_name: !!timestamp 2001-12-14\n", "'tag:yaml.org,2002:timestamp'"),
    "set": (HEAD + "algorithm:\n  plugins: !!set {a, b}\n", "'tag:yaml.org,2002:set'"),
    "omap": (HEAD + "algorithm:\n  plugins: !!omap [a: 1]\n", "'tag:yaml.org,2002:omap'"),
    "pairs": (HEAD + "algorithm:\n  plugins: !!pairs [a: 1]\n", "'tag:yaml.org,2002:pairs'"),
    "custom tag": (HEAD + "trainer:\n  run_name: !mine x\n", "'!mine'"),
    "python tag": (HEAD + "trainer:\n  run_name: !!python/tuple [1, 2]\n", "python/tuple"),
    "a list as a key": (HEAD + "trainer:\n  ? [a, b]\n  : 1\n", "a mapping key that is not a string"),
    "a mapping as a key": (HEAD + "trainer:\n  ? {a: 1}\n  : 1\n", "a mapping key that is not a string"),
    "a binary key": (HEAD + "trainer:\n  !!binary aGVsbG8=: 1\n", "a mapping key that is not a string"),
    "a tag that does not fit its text": (HEAD + "trainer:\n  steps: !!int abc\n", "cannot build it (ValueError"),
    "defaults of a number": ("defaults:\n  - 1\n", "cannot build it (ValueError: Unsupported type in defaults"),
    "defaults of null": ("defaults:\n  - null\n", "cannot build it (ValueError"),
    "defaults as a mapping": ("defaults: {a: 1}\n", "defaults must be a list"),
    "defaults holding a list": ("defaults:\n  - config\n  - [a]\n", "cannot build it (ValueError"),
    "a null key": (HEAD + "trainer:\n  ~: 1\n", "a mapping key that is not a string"),
    "an int key": (HEAD + "trainer:\n  5: 1\n", "Key '5' not in 'TrainerConfig'"),
}


@pytest.mark.parametrize("case", list(UNBUILDABLE))
def test_a_config_file_the_library_cannot_build_is_one_line_naming_it(tmp_path, case):
    from fsdptrain.config import ConfigError
    from fsdptrain.config.compose import compose_config

    text, culprit = UNBUILDABLE[case]
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        compose_config([], config_dir=str(tmp_path), config_name="mine")
    line = str(err.value)
    assert culprit in line and "\n" not in line, line
    assert "mine.yaml" in line or "In 'mine'" in line, line


def test_merge_keys_and_a_plain_date_still_build(tmp_path):
    from fsdptrain.config.compose import compose_config

    (tmp_path / "mine.yaml").write_text(HEAD + "trainer:\n  <<: {steps: 3}\n  run_name: 2001-12-14\n")
    cfg = compose_config([], config_dir=str(tmp_path), config_name="mine")
    assert cfg.trainer.steps == 3 and cfg.trainer.run_name == "2001-12-14"


LEVELS = ["model.value_init", "algorithm.kl_estimator", "data.prompt_key", "reward.model_normalize",
          "rollout.gather_weights", "trainer.lr_schedule", "parallel.compile_backend"]
FORMS = {  # every form OmegaConf's resolver follows to another value: (the reference to `prev`, from `key`)
    "absolute": lambda prev, key: f"${{{prev}}}",
    "relative": lambda prev, key: f"${{..{prev}}}",
    "bracketed": lambda prev, key: "${%s[%s]}" % tuple(prev.split(".")),
    "oc.select": lambda prev, key: f"${{oc.select:{prev}}}",
    "oc.select's default": lambda prev, key: f"${{oc.select:no.such_key,${{{prev}}}}}",
    "oc.deprecated": lambda prev, key: f"${{oc.deprecated:{prev}}}",
    "oc.env's default": lambda prev, key: f"${{oc.env:FSDPTRAIN_UNSET_VARIABLE,${{{prev}}}}}",
    "quoted resolver argument": lambda prev, key: f"${{oc.select:no.such_key,'${{{prev}}}'}}",
}


def _chain(form) -> dict:
    """Seven string fields, each its predecessor ten times through ``form``: 3 x 10^6 characters at the end."""
    raw: dict = {}
    for i, key in enumerate(LEVELS):
        group, name = key.split(".")
        raw.setdefault(group, {})[name] = "lol" if i == 0 else form(LEVELS[i - 1], key) * 10
    return raw


@pytest.mark.parametrize("form", list(FORMS))
def test_every_followed_interpolation_form_counts_what_it_resolves_to(form):
    problem = check_interpolations(_chain(FORMS[form]))
    assert problem is not None and problem.startswith(f"{LEVELS[-1]}: its interpolations (${{...}}) expand to about"), \
        problem


REFUSED = {  # forms whose size the count cannot know before resolving
    "a key built from an interpolation": ("${model.${data.prompt_key}}", "builds a key from another interpolation"),
    "oc.create": ("${oc.create:${model}}", "the resolver 'oc.create'"),
    "oc.decode": ("${oc.decode:'${model.value_init}'}", "the resolver 'oc.decode'"),
    "hydra": ("${hydra:runtime.cwd}", "the resolver 'hydra'"),
    "now": ("${now:%H}", "the resolver 'now'"),
    "an unknown resolver": ("${mine:1}", "the resolver 'mine'"),
    "a resolver named by an interpolation": ("${${data.prompt_key}:1}", "is not one the expansion bound follows"),
    "oc.env naming its variable through an interpolation": ("${oc.env:${data.prompt_key}}", "names its variable"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_form_the_count_cannot_follow_is_refused_before_resolving(case):
    value, culprit = REFUSED[case]
    problem = check_interpolations({"model": {"value_init": "x"}, "data": {"prompt_key": "value_init"},
                                    "trainer": {"run_name": value}})
    assert problem is not None and problem.startswith("trainer.run_name: ") and culprit in problem, problem


def test_an_environment_variable_and_a_container_count_their_real_length(monkeypatch):
    monkeypatch.setenv("FSDPTRAIN_BIG", "x" * (MAX_VALUE_CHARS + 1))
    assert check_interpolations({"a": "${oc.env:FSDPTRAIN_BIG}"}).startswith("a: its interpolations")
    raw = {"g": {"k" * 1000: "v"}, "a": "${g}" * 1001}  # a container interpolated into a string is its text
    assert interpolation_sizes(raw)["a"] >= 1000 * 1001 and check_interpolations(raw) is not None


def test_escapes_and_dict_resolvers_are_counted_as_they_resolve():
    sizes = interpolation_sizes({"g": {"a": "xy"}, "e": "\\${g.a}", "v": "${oc.dict.values:g}",
                                 "k": "${oc.dict.keys:g}"})
    assert sizes["e"] == len("\\${g.a}") and sizes["v"] >= 2 and sizes["k"] >= 1


def test_a_chain_through_a_resolver_argument_is_refused_by_compose_before_it_resolves(tmp_path):
    from fsdptrain.config import ConfigError
    from fsdptrain.config.compose import compose_config

    lines = ["defaults:", "  - config", "  - _self_"]
    for group, fields in _chain(FORMS["oc.select's default"]).items():
        lines += [f"{group}:"] + [f"  {name}: {json.dumps(value)}" for name, value in fields.items()]
    (tmp_path / "mine.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="parallel.compile_backend: its interpolations"):
        compose_config([], config_dir=str(tmp_path), config_name="mine")
