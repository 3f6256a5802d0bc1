"""Named registration of a user's advantage estimators and policy losses, and the import of the modules that do it.

A user's module (listed in `algorithm.plugins`, imported at start in the CLI's parent and on every rank) writes

    import fsdptrain

    @fsdptrain.register_policy_loss("my_loss")
    def my_loss(logprobs, old_logprobs, advantages, valid, *, layout, settings): ...

and the config names it `algorithm.policy_loss=my_loss`, as verl's `@register_policy_loss` / `@register_adv_est`.
The decorator returns the function unchanged; an Enum member (verl's `AdvantageEstimator.X`) registers its string value. Registering a name twice with a different function is a ConfigError
naming both; the same function twice is allowed (a module imported twice); a built-in name cannot be taken. The
signature is checked when the name is resolved (`fsdptrain.registry.user_functions.resolve_function`). Nothing here
imports torch; a plugin that imports it makes the parent import it too.
"""

from __future__ import annotations

import enum
import importlib
from pathlib import Path
from typing import Callable, Sequence

from fsdptrain.registry.errors import ConfigError
from fsdptrain.registry.names import ADV_ESTIMATORS, POLICY_LOSSES
from fsdptrain.registry.user_functions import load_file

_REGISTERED: dict[str, dict[str, Callable]] = {"algorithm.adv_estimator": {}, "algorithm.policy_loss": {}}
_BUILT_INS = {"algorithm.adv_estimator": ADV_ESTIMATORS, "algorithm.policy_loss": POLICY_LOSSES}


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def registration_name(name: str | enum.Enum, field: str = "algorithm.adv_estimator") -> str:
    """The name a registration (or a lookup) uses: the string itself, or an Enum member's string value.

    verl names its estimators by an Enum whose values are the config strings (`AdvantageEstimator.GRPO` has value
    "grpo"); registering the member is registering its value. ConfigError for anything else, or for an empty name or
    one with ':' (a `module:function` spec).
    """
    raw = name.value if isinstance(name, enum.Enum) else name
    if not isinstance(raw, str) or not raw or ":" in raw:
        raise ConfigError(f"{field}: cannot register {name!r}: a name is a non-empty string without ':' "
                          "(or an Enum member whose value is one)")
    return raw


def _register(field: str, name: str | enum.Enum) -> Callable[[Callable], Callable]:
    name = registration_name(name, field)
    if name in _BUILT_INS[field]:
        raise ConfigError(f"{field}: cannot register {name!r}: it is a built-in ({', '.join(_BUILT_INS[field])})")

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise ConfigError(f"{field}: cannot register {name!r}: {fn!r} is not a function")
        held = _REGISTERED[field].get(name)
        if held is not None and held is not fn:
            raise ConfigError(f"{field}: {name!r} is registered twice, by {_describe(held)} and by {_describe(fn)}")
        _REGISTERED[field][name] = fn
        return fn

    return decorate


def register_adv_estimator(name: str | enum.Enum) -> Callable[[Callable], Callable]:
    """Decorator: `algorithm.adv_estimator=name` selects the function (signature: `ADV_ESTIMATOR_ARGS`); an Enum
    member registers its value (`registration_name`)."""
    return _register("algorithm.adv_estimator", name)


def register_policy_loss(name: str | enum.Enum) -> Callable[[Callable], Callable]:
    """Decorator: `algorithm.policy_loss=name` selects the function (signature: `POLICY_LOSS_ARGS`); an Enum member
    registers its value (`registration_name`)."""
    return _register("algorithm.policy_loss", name)


def registered(field: str) -> dict[str, Callable]:
    """The names registered so far for `field` ("algorithm.adv_estimator" or "algorithm.policy_loss")."""
    return dict(_REGISTERED.get(field, {}))


def import_plugins(specs: Sequence[str]) -> None:
    """Import each plugin: a dotted module name (from `sys.path`) or a `path/to/file.py` (relative to the working
    directory). ConfigError (one line, naming `algorithm.plugins`) for a module or file that is not there."""
    for spec in specs:
        spec = str(spec)
        if spec.endswith(".py") or "/" in spec or "\\" in spec:
            load_file(Path(spec), spec=spec, what="algorithm.plugins")
            continue
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as err:
            raise ConfigError(f"algorithm.plugins: cannot import module {spec!r}: {err}") from None
