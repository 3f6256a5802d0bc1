"""Bounds on config expansion (fsdptrain/config/expansion.py): sizes counted by hand on small files and configs."""

from __future__ import annotations

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
    assert sizes["x"] == 2 and sizes["y"] == 5 and sizes["z.w"] == 5 and sizes["z.v"] == 6 and sizes["z.s"] == 2
    assert sizes["e"] == len("oc.env:HOME") and sizes["n"] == 2 and sizes["z"] == 1 + 5 + 6 + 2


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
