"""Counting the calls of the packed attention backends, for tests only: the registered functions are wrapped in
transformers' AttentionInterface, so the product's hot path carries no counter.

A model switched to a packed backend looks its attention up in the interface at every forward, so the counts prove
the registered backend served each layer (transformers' own packed-mask path on plain sdpa would give the same
numbers). Direct calls of a backend function are not counted.
"""

from __future__ import annotations

import collections
import functools

from transformers import AttentionInterface

from fsdptrain.model.attention_backends import BACKEND_FUNCTIONS
from fsdptrain.model.attention_switch import register_backends

_COUNTS: collections.Counter[str] = collections.Counter()


def _counting(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _COUNTS[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def install() -> None:
    """Wrap every packed backend registered with transformers (idempotent)."""
    register_backends()
    registry = AttentionInterface()
    for name in BACKEND_FUNCTIONS:
        if not getattr(registry[name], "_counted", False):
            wrapped = _counting(name, registry[name])
            wrapped._counted = True
            AttentionInterface.register(name, wrapped)


def call_counts() -> dict[str, int]:
    """Calls of each packed backend through transformers since the last reset."""
    install()
    return dict(_COUNTS)


def reset_call_counts() -> None:
    install()
    _COUNTS.clear()
