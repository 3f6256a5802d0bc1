"""Resolve ``reward.functions`` and ``reward.weights`` at start-up: every mistake is one ConfigError before any model.

A name is a built-in (:data:`fsdptrain.rewards.builtin.BUILTINS`), ``package.module:function`` or
``path/to/file.py:function``. Each function must accept ``prompts, completions, completion_ids`` and ``**kwargs``
(the dataset's other columns); a parameter without a default that is not one of those must be a column of the dataset.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.registry.user_functions import check_signature, load_callable
from fsdptrain.rewards.builtin import BUILTINS, REQUIREMENTS

REQUIRED_ARGS = ("prompts", "completions", "completion_ids")


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward: ``name`` (metric key: the built-in name or the function's name), the ``spec`` as
    configured (worker processes load it again from this), the callable and its weight; ``method``, when the callable
    stands for a method of the user's (an environment's ``get_reward``), is named in errors."""

    name: str
    spec: str
    fn: Callable
    weight: float
    method: str = ""

    @property
    def label(self) -> str:
        """The name errors give: ``name``, or ``name.method``."""
        return f"{self.name}.{self.method}" if self.method else self.name


def resolve(spec: str) -> Callable:
    """The callable a spec names: a built-in, else :func:`fsdptrain.registry.user_functions.load_callable`."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    return load_callable(spec, what="reward.functions")


def load_reward_functions(specs: Sequence[str], weights: Optional[Sequence[float]] = None, *,
                          columns: Optional[Sequence[str]] = None) -> list[RewardFunction]:
    """The configured reward functions, checked: a ConfigError (one line) names the first bad entry.

    ``weights`` None means 1.0 each; otherwise one finite weight per function. ``columns`` (the dataset's columns
    other than the prompt), when given, must cover every parameter a function requires beyond the three fixed ones.
    Two functions with the same metric name are an error (their metrics would collide).
    """
    if not specs:
        raise ConfigError("reward.functions is empty: name at least one reward function")
    if weights is None:
        weights = [1.0] * len(specs)
    if len(weights) != len(specs):
        raise ConfigError(f"reward.weights has {len(weights)} entries for {len(specs)} reward.functions")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"reward.weights: {w!r} is not a finite number")
    out: list[RewardFunction] = []
    for spec, weight in zip(specs, weights):
        if spec in REQUIREMENTS:
            module, extra = REQUIREMENTS[spec]
            require_module(module, extra=extra, what=f"reward.functions: {spec!r}")
        fn = resolve(spec)
        check_signature(fn, spec=spec, what="reward.functions", required=REQUIRED_ARGS, var_keyword=True)
        if columns is not None:
            _check_columns(fn, spec=spec, columns=columns)
        name = spec if spec in BUILTINS else spec.rpartition(":")[2]
        if any(f.name == name for f in out):
            raise ConfigError(f"reward.functions: two functions are named {name!r}; their metrics would collide")
        out.append(RewardFunction(name=name, spec=spec, fn=fn, weight=float(weight)))
    return out


def require_module(module: str, *, extra: str, what: str) -> None:
    """ConfigError naming ``pip install <extra>`` when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the {module} package: pip install {extra}")


def _check_columns(fn: Callable, *, spec: str, columns: Sequence[str]) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    for name, p in params.items():
        if (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                and name not in REQUIRED_ARGS and name not in columns):
            raise ConfigError(f"reward.functions: {spec!r} needs a column {name!r} that the dataset does not have "
                              f"(columns: {sorted(columns)})")
