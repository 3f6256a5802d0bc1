"""Loading a user's function by name: both spellings, and one clear ConfigError for each way it can be wrong."""

import pytest

from fsdptrain.config import ConfigError
from fsdptrain.registry.user_functions import check_signature, load_callable


def test_loads_from_a_file_and_from_a_module(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n")
    fn = load_callable(f"{f}:score", what="reward.functions")
    assert fn(["p"], ["c"]) == [1.0]
    assert load_callable("os.path:join", what="x")("a", "b") == "a/b"


@pytest.mark.parametrize("spec, fragment", [
    ("no_colon", "not of the form"),
    ("{dir}/missing.py:f", "not found"),
    ("{dir}/ok.py:nope", "has no attribute 'nope'"),
    ("{dir}/ok.py:VALUE", "is a int, not a function"),
    ("{dir}/bad.py:f", "line 1: syntax error"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
])
def test_each_bad_spec_is_one_config_error(tmp_path, spec, fragment):
    (tmp_path / "ok.py").write_text("VALUE = 3\n")
    (tmp_path / "bad.py").write_text("def f(:\n")
    with pytest.raises(ConfigError, match="reward.functions") as err:
        load_callable(spec.format(dir=tmp_path), what="reward.functions")
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_signature_checks():
    def good(prompts, completions, completion_ids, **columns):
        return []

    def no_kwargs(prompts, completions, completion_ids):
        return []

    def lacks_ids(prompts, completions, **columns):
        return []

    def extra_required(a, b):
        return []

    required = ("prompts", "completions", "completion_ids")
    check_signature(good, spec="g", what="w", required=required, var_keyword=True)
    check_signature(lacks_ids, spec="g", what="w", required=required, var_keyword=True)  # **columns takes it
    with pytest.raises(ConfigError, match="add \\*\\*kwargs"):
        check_signature(no_kwargs, spec="n", what="w", required=required, var_keyword=True)
    with pytest.raises(ConfigError, match="no parameter 'c'"):
        check_signature(extra_required, spec="e", what="w", required=("a", "c"))
    with pytest.raises(ConfigError, match="'b' would never be set"):
        check_signature(extra_required, spec="e", what="w", required=("a",))
