"""Laying typed metrics out as flat buffers for a rank reduction, and back (docs/metrics.md).

A rank reduction all-reduces three float64 buffers (SUM, MIN, MAX). The caller (fsdptrain/train/step.py) does the
collectives; this module only flattens and unflattens, in the order of a :class:`Schema` every rank must share.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fsdptrain.metrics.typed import _F64, Diagnostic, Metric, Metrics, merge_all


class Schema(Mapping[str, Metric]):
    """The names (sorted) and empty templates of the metrics a rank reduction carries.

    Every rank must use the same schema. Loss functions here always return the same names for the same
    arguments, empty pack or not, so `Schema.of(local_collection)` agrees across ranks when the ranks run the same
    code; `fingerprint` is a cheap integer the trainer can compare across ranks (all_reduce MIN and MAX) to be
    sure. A collection may lack names of the schema (they reduce as empty) but never hold names outside it.
    """

    def __init__(self, templates: Mapping[str, Metric]):
        self._templates = {name: templates[name].empty() for name in sorted(templates)}

    @staticmethod
    def of(*collections: Mapping[str, Metric]) -> Schema:
        return Schema(merge_all(collections))

    def __getitem__(self, name):
        return self._templates[name]

    def __iter__(self):
        return iter(self._templates)

    def __len__(self):
        return len(self._templates)

    def fingerprint(self) -> int:
        text = ";".join(f"{n}:{describe(m)}" for n, m in self._templates.items())
        return zlib.crc32(text.encode())


def describe(m: Metric) -> str:
    """A metric's kind and layout in a few characters (what the schema's fingerprint hashes)."""
    inner = describe(m.inner) if isinstance(m, Diagnostic) else ""
    return f"{m.kind.value}{len(m.slots())}{inner}"


@dataclass(frozen=True)
class ReduceBuffers:
    """Stats to all-reduce: `sum` with SUM, `min` with MIN, `max` with MAX (float64, 1-D, possibly empty)."""

    sum: Tensor
    min: Tensor
    max: Tensor


def flatten(
    collection: Mapping[str, Metric], schema: Schema, device: torch.device | str = "cpu"
) -> ReduceBuffers:
    """Lay the collection out in the schema's order, one buffer per reduce op, for the trainer's all_reduce calls."""
    extra = set(collection) - set(schema)
    if extra:
        raise ValueError(f"metrics {sorted(extra)} are not in the schema; build the schema from every metric name")
    slots: dict[str, list[Tensor]] = {"sum": [], "min": [], "max": []}
    for name, template in schema.items():
        metric = collection.get(name, template)
        if describe(metric) != describe(template):
            raise ValueError(f"metric {name!r} does not match the schema ({describe(metric)} vs {describe(template)})")
        for op, stat in metric.slots():
            slots[op].append(stat.to(device=device, dtype=_F64))
    return ReduceBuffers(*(_stack(slots[op], device) for op in ("sum", "min", "max")))


def unflatten(buffers: ReduceBuffers, schema: Schema) -> Metrics:
    """Rebuild the collection from reduced buffers (inverse of `flatten`); every schema name comes back."""
    cursor = {"sum": 0, "min": 0, "max": 0}
    source = {"sum": buffers.sum, "min": buffers.min, "max": buffers.max}
    out = {}
    for name, template in schema.items():
        stats = []
        for op, _ in template.slots():
            stats.append(source[op][cursor[op]])
            cursor[op] += 1
        out[name] = template.from_slots(stats)
    assert all(cursor[op] == source[op].numel() for op in cursor), "buffers do not match the schema"
    return Metrics(out)


def _stack(stats: list[Tensor], device) -> Tensor:
    if not stats:
        return torch.zeros(0, dtype=_F64, device=device)
    return torch.stack(stats)
