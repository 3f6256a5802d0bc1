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
from fsdptrain.registry.user_paths import user_path


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
        except (Exception, SystemExit) as err:  # the module's own code failed while it was imported
            raise ConfigError(f"{what}: importing module {module_part!r} failed: {describe_exception(err)} "
                              f"(from {spec!r})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{what}: {module_part!r} has no attribute {name!r} (from {spec!r})")
    if not callable(fn):
        raise ConfigError(f"{what}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def load_file(path: Path, *, spec: str, what: str):
    """The module of the Python file at ``path``, executed once per process (cached under a private name).

    The file is imported as ``python path/to/file.py`` would run it: its own folder is first on ``sys.path`` while it
    is imported, so ``import helpers`` finds ``path/to/helpers.py`` (in the training process and in reward workers
    alike); the folder is taken off ``sys.path`` again afterwards. Anything the import raises (a syntax error, a missing
    module, ``1/0`` at top level, ``sys.exit()``) is a ConfigError naming the file and the line of the file where it
    happened; a Ctrl-C passes through. No bytecode cache is written next to the file.
    """
    if path.exists():
        user_path(path, key=what)  # a named pipe would hold the import forever
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
    folder, write_bytecode = str(resolved.parent), sys.dont_write_bytecode
    sys.path.insert(0, folder)
    sys.dont_write_bytecode = True  # no __pycache__ in the user's folder: fsdptrain writes only its run folder
    try:
        file_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[module_name]
        where = f"line {err.lineno}" if err.filename == str(resolved) else f"{err.filename} line {err.lineno}"
        raise ConfigError(f"{what}: {str(path)!r} {where}: syntax error: {err.msg} (from {spec!r})") from None
    except (Exception, SystemExit) as err:
        del sys.modules[module_name]
        raise ConfigError(f"{what}: importing {str(path)!r} failed at line {_line_in(err, resolved)}: "
                          f"{describe_exception(err)} (from {spec!r})") from None
    finally:
        sys.path.remove(folder)
        sys.dont_write_bytecode = write_bytecode
    return module


def describe_exception(err: BaseException) -> str:
    """``TypeName: message`` of a user's exception on one line; ``sys.exit(code)`` reads as such."""
    if isinstance(err, SystemExit):
        return f"it called sys.exit({err.code!r})"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _line_in(err: BaseException, file: Path) -> str:
    """The line of ``file`` in ``err``'s traceback that was running when it was raised ("?" if none was)."""
    line = "?"
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(file):
            line = str(tb.tb_lineno)
        tb = tb.tb_next
    return line


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
