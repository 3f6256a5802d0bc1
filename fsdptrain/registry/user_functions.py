"""Load a user's function named as ``module:function`` or ``path/to/file.py:function``, and check its signature.

Reward functions, advantage estimators and policy losses are all named this way in the config. Loading happens at
start-up, before any model is built, so a typo is one line and exit 2 (a :class:`~fsdptrain.registry.errors.ConfigError`),
never a traceback from inside a rank. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from fsdptrain.registry.errors import ConfigError


def load_callable(spec: str, *, what: str) -> Callable:
    """The callable named by ``spec``; ``what`` names the config field in errors (e.g. ``reward.functions``).

    ``spec`` is ``package.module:function`` (imported from ``sys.path``) or ``path/to/file.py:function`` (a path,
    relative to the working directory, whose module is loaded under a private name so two files with the same stem
    do not collide). Raises ConfigError naming the field and the spec when the file, the module or the name is missing,
    or when the object is not callable.
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise ConfigError(f"{what}: {spec!r} is not of the form module:function or path/to/file.py:function")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = load_file(Path(module_part), spec=spec, what=what)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as err:
            raise ConfigError(f"{what}: cannot import module {module_part!r} (from {spec!r}): {err}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{what}: {module_part!r} has no attribute {name!r} (from {spec!r})")
    if not callable(fn):
        raise ConfigError(f"{what}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def load_file(path: Path, *, spec: str, what: str):
    """The module of the Python file at ``path``, executed once per process (cached under a private name)."""
    if not path.is_file():
        raise ConfigError(f"{what}: file {str(path)!r} not found (from {spec!r})")
    resolved = path.resolve()
    module_name = f"fsdptrain_user_{abs(hash(str(resolved))):x}_{resolved.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    file_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if file_spec is None or file_spec.loader is None:
        raise ConfigError(f"{what}: cannot load {str(path)!r} as a Python file (from {spec!r})")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[module_name]
        raise ConfigError(f"{what}: {str(path)!r} line {err.lineno}: syntax error: {err.msg}") from None
    return module


def check_signature(fn: Callable, *, spec: str, what: str, required: Sequence[str], var_keyword: bool = False) -> None:
    """Check that ``fn`` can be called with the keyword arguments ``required`` (and ``**columns`` if ``var_keyword``).

    A parameter of ``fn`` without a default that is not in ``required`` (and not ``*args``/``**kwargs``) would fail at
    the first call; so would a missing ``**kwargs`` when ``var_keyword`` is set. Either is a ConfigError naming the spec,
    the expected signature and what is wrong.
    """
    expected = ", ".join([*required, *(["**kwargs"] if var_keyword else [])])
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # builtins and C functions expose no signature; the first call will tell
    accepts_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [r for r in required if r not in names and not accepts_any_keyword]
    if missing:
        raise ConfigError(f"{what}: {spec!r} must accept ({expected}); it has no parameter {missing[0]!r}")
    unfilled = [n for n, p in params.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and n not in required]
    if unfilled and not var_keyword:
        raise ConfigError(f"{what}: {spec!r} must accept ({expected}); its parameter {unfilled[0]!r} would never be set")
    if var_keyword and not accepts_any_keyword:
        raise ConfigError(f"{what}: {spec!r} must accept ({expected}); add **kwargs to receive the dataset's columns")


def resolve_function(name_or_spec: str, registry: dict, *, what: str, required: Sequence[str],
                     plugged: Optional[dict] = None) -> Callable:
    """``registry[name_or_spec]`` for a built-in, else ``plugged[name_or_spec]`` (the names plugins registered for
    the field ``what``, `fsdptrain.registry.plugins.registered`), else the user's ``module:function`` / ``path.py:function``, loaded; a user's function is
    checked to take ``required`` by keyword. ConfigError (one line) for an unknown name or a function that does not
    fit."""
    plugged = plugged or {}
    if name_or_spec in registry:
        return registry[name_or_spec]
    if name_or_spec in plugged:
        fn = plugged[name_or_spec]
        check_signature(fn, spec=name_or_spec, what=what, required=required)
        return fn
    if ":" not in name_or_spec:
        registered = f", nor a registered name ({', '.join(plugged)})" if plugged else ""
        raise ConfigError(f"{what}={name_or_spec!r} is not a built-in ({', '.join(registry)}){registered} "
                          "nor of the form module:function or path/to/file.py:function")
    fn = load_callable(name_or_spec, what=what)
    check_signature(fn, spec=name_or_spec, what=what, required=required)
    return fn
