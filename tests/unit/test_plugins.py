"""Named registration (`fsdptrain.register_policy_loss` / `register_adv_estimator`) and `algorithm.plugins`."""

import enum

import pytest

import fsdptrain
from fsdptrain.config.compose import compose_config
from fsdptrain.registry import plugins
from fsdptrain.registry.errors import ConfigError
from fsdptrain.rl.estimator_registry import resolve_adv_estimator
from fsdptrain.rl.pg_terms import resolve_policy_loss


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(plugins, "_REGISTERED", {"algorithm.adv_estimator": {}, "algorithm.policy_loss": {}})


def my_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    return -advantages * logprobs, {}


def other_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    return advantages * logprobs, {}


def my_adv(token_rewards_BT, values_BT, mask_BT, scores_N, group_ids_N, settings):
    return token_rewards_BT, token_rewards_BT


def test_the_decorator_returns_the_function_and_the_name_resolves():
    assert fsdptrain.register_policy_loss("mine")(my_loss) is my_loss
    assert fsdptrain.register_adv_estimator("mine")(my_adv) is my_adv
    assert resolve_policy_loss("mine") is my_loss
    assert resolve_adv_estimator("mine") is my_adv


def test_the_same_function_twice_is_allowed():
    fsdptrain.register_policy_loss("mine")(my_loss)
    assert fsdptrain.register_policy_loss("mine")(my_loss) is my_loss
    assert plugins.registered("algorithm.policy_loss") == {"mine": my_loss}


def test_a_name_twice_with_another_function_names_both():
    fsdptrain.register_policy_loss("mine")(my_loss)
    with pytest.raises(ConfigError) as err:
        fsdptrain.register_policy_loss("mine")(other_loss)
    assert str(err.value) == (f"algorithm.policy_loss: 'mine' is registered twice, by {__name__}.my_loss and by "
                              f"{__name__}.other_loss")
    assert resolve_policy_loss("mine") is my_loss


@pytest.mark.parametrize("name", ["vanilla", "gmpo"])
def test_a_built_in_name_cannot_be_taken(name):
    with pytest.raises(ConfigError, match=f"cannot register '{name}': it is a built-in"):
        fsdptrain.register_policy_loss(name)
    with pytest.raises(ConfigError, match="cannot register 'grpo': it is a built-in"):
        fsdptrain.register_adv_estimator("grpo")


@pytest.mark.parametrize("name", ["", "mod:fn", None])
def test_a_bad_name_is_refused(name):
    with pytest.raises(ConfigError, match="a name is a non-empty string without ':'"):
        fsdptrain.register_policy_loss(name)


class Estimators(enum.Enum):
    MINE = "mine"
    GRPO = "grpo"
    NUMBERED = 3


def test_an_enum_member_registers_its_value():
    assert fsdptrain.register_adv_estimator(Estimators.MINE)(my_adv) is my_adv
    assert plugins.registered("algorithm.adv_estimator") == {"mine": my_adv}
    assert resolve_adv_estimator("mine") is my_adv
    assert fsdptrain.register_adv_estimator("mine")(my_adv) is my_adv  # the same name, string or member
    with pytest.raises(ConfigError, match="'mine' is registered twice"):
        fsdptrain.register_adv_estimator(Estimators.MINE)(lambda **_: None)


def test_an_enum_member_of_a_built_in_or_without_a_string_value_is_refused():
    with pytest.raises(ConfigError, match="cannot register 'grpo': it is a built-in"):
        fsdptrain.register_adv_estimator(Estimators.GRPO)
    with pytest.raises(ConfigError, match="an Enum member whose value is one"):
        fsdptrain.register_adv_estimator(Estimators.NUMBERED)


def test_the_two_fields_have_their_own_names():
    fsdptrain.register_policy_loss("mine")(my_loss)
    with pytest.raises(ConfigError, match=r"'mine' is not a built-in \(gae, grpo"):
        resolve_adv_estimator("mine")


def test_a_registered_function_of_the_wrong_shape_is_refused_when_resolved():
    fsdptrain.register_policy_loss("bad")(lambda logprobs: logprobs)
    with pytest.raises(ConfigError, match="must accept"):
        resolve_policy_loss("bad")


PLUGIN = '''
import fsdptrain

@fsdptrain.register_policy_loss("from_file")
def from_file(logprobs, old_logprobs, advantages, valid, *, layout, settings):
    return -advantages * logprobs, {}
'''


def test_plugins_are_imported_by_validation_and_their_names_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(PLUGIN)
    with pytest.raises(ConfigError, match="'from_file' is not a valid choice; choose one of: vanilla"):
        compose_config(["algorithm.policy_loss=from_file"])
    cfg = compose_config(["algorithm.plugins=[mine.py]", "algorithm.policy_loss=from_file"])
    assert cfg.algorithm.policy_loss == "from_file"
    assert resolve_policy_loss("from_file").__name__ == "from_file"


@pytest.mark.parametrize("spec, message", [
    ("missing.py", "algorithm.plugins: file 'missing.py' not found"),
    ("no_such_module_xyz", "algorithm.plugins: cannot import module 'no_such_module_xyz'"),
])
def test_a_missing_plugin_is_one_line(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        compose_config([f"algorithm.plugins=[{spec}]"])
