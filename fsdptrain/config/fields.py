"""Field constructors that declare a config field's choices or range next to its default, and the readers of both.

``schema.py`` writes ``attn_backend: str = choice("auto", ATTN_BACKENDS)`` or ``gamma: float = bounded(1.0, ge=0,
le=1)``; the declaration lands in the dataclass field's ``metadata``, which :mod:`fsdptrain.config.validate` checks
right after composition and :mod:`fsdptrain.config.docs` prints in docs/configuration.md. Hydra and OmegaConf ignore
field metadata, so the structured config is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

_INF = math.inf


@dataclass(frozen=True)
class Range:
    """The closed or open interval a number must lie in (and it must be finite): ``low <(=) value <(=) high``."""

    low: float
    low_in: bool
    high: float = _INF
    high_in: bool = False

    def contains(self, value: float) -> bool:
        above = value >= self.low if self.low_in else value > self.low
        below = value <= self.high if self.high_in else value < self.high
        return math.isfinite(value) and above and below

    def describe(self) -> str:
        """The phrase after "must be" in the error message: "a finite number >= 0", "a number in (0, 1]"."""
        if self.high == _INF:
            return f"a finite number {'>=' if self.low_in else '>'} {self.low:g}"
        return f"a number in {'[' if self.low_in else '('}{self.low:g}, {self.high:g}{']' if self.high_in else ')'}"


def choice(default: Optional[str], choices: Sequence[str], *, user_function: bool = False) -> Any:
    """A string field that takes one of ``choices``; with ``user_function`` also a user's function named as
    ``module:function`` or ``path/to/file.py:function`` (loaded and its signature checked by the CLI)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices), "user_function": user_function})


def each_of(choices: Sequence[str], default_factory: Callable[[], list]) -> Any:
    """A list field whose every item is one of ``choices``."""
    return dataclasses.field(default_factory=default_factory, metadata={"each_of": tuple(choices)})


def bounded(default: Optional[float], *, gt: Optional[float] = None, ge: Optional[float] = None,
            lt: Optional[float] = None, le: Optional[float] = None) -> Any:
    """A number field (int or float, null allowed when the type is Optional) in the range ``gt``/``ge`` .. ``lt``/``le``;
    an int field takes ``ge=0`` (a count or interval) or ``ge=1`` (a positive size)."""
    assert (gt is None) != (ge is None), "give one lower bound: gt or ge"
    assert lt is None or le is None, "give at most one upper bound: lt or le"
    high = lt if lt is not None else le if le is not None else _INF
    bounds = Range(gt if gt is not None else ge, ge is not None, high, le is not None)
    return dataclasses.field(default=default, metadata={"range": bounds})


def each_bounded(default_factory: Callable[[], list], *, ge: int) -> Any:
    """A list-of-ints field whose every item is an integer >= ``ge`` (rules against other fields, such as an upper
    bound set by another field, live in validate.py)."""
    return dataclasses.field(default_factory=default_factory, metadata={"each_range": Range(ge, True)})


def unbounded(default: float) -> Any:
    """A float field that takes any finite number."""
    return dataclasses.field(default=default, metadata={"range": Range(-_INF, False)})


def field_choices(f: dataclasses.Field) -> Optional[tuple[str, ...]]:
    """The choices declared on a field (for one value or for each item of a list), or None."""
    return f.metadata.get("choices") or f.metadata.get("each_of")


def field_range(f: dataclasses.Field) -> Optional[Range]:
    """The range declared on a number field, or None."""
    return f.metadata.get("range")


def field_item_range(f: dataclasses.Field) -> Optional[Range]:
    """The range declared on each item of a list-of-ints field (:func:`each_bounded`), or None."""
    return f.metadata.get("each_range")


def flat_fields(schema: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field, Any, type]]:
    """``(dotted name, field, type hint, owning dataclass)`` of every leaf field of ``schema`` under ``prefix``; a
    field whose type is itself a dataclass (``model.lora``) is flattened into its own fields (``model.lora.r``)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from flat_fields(hint, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", f, hint, schema
