"""Typed metrics: every metric carries its sufficient statistics and its own reduction (docs/metrics.md).

A metric's kind, never its name, decides how it merges. The life of a metric in one training step:

1. a loss function returns a `Metrics` collection for one pack (micro-batch);
2. `merge` combines packs and micro-batches of one mini-batch on a rank;
3. the trainer reduces ranks: `flatten(collection, schema)` gives three float64 tensors for
   `all_reduce(SUM)`, `all_reduce(MIN)` and `all_reduce(MAX)`, and `unflatten(buffers, schema)` rebuilds the
   collection (this module never calls torch.distributed);
4. `close_minibatch` seals a mini-batch, and `merge` then combines mini-batches and epochs;
5. `finalize` turns the collection into the `dict[str, float]` that is logged.

Reductions per kind:
- SUM: a count; adds everywhere.
- MEAN: a total and a count (the weighting is the producer's: token- or sequence-weighted); pooled everywhere.
- MIN / MAX: extrema over the valid elements only; empty is the identity (+inf / -inf) while merging and the key
  is absent after `finalize`.
- LOSS: a part of one mini-batch's scalar; summed within a mini-batch (sequences, packs, micro-batches, ranks), then
  averaged over closed mini-batches and epochs. Its mini-batch count reduces over ranks with MAX (every rank closes
  the same mini-batches), so ranks may be reduced before or after closing.
- DERIVED: additive sufficient statistics and a pure function of them, evaluated in `finalize` (exact under any
  split); the function may return None (undefined, e.g. a zero variance) and the key is then absent.
- DIAGNOSTIC: a fact about how the work was run (timings, fill); wraps another metric whose reduction it uses, and
  is skipped wherever metrics are compared (`comparable`).

Stats are detached float64 0-d tensors on the producer's device; only `finalize` copies to the host.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

_F64 = torch.float64


class Kind(enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    LOSS = "loss"
    DERIVED = "derived"
    DIAGNOSTIC = "diagnostic"


def _stat(x: Tensor | float | int) -> Tensor:
    if isinstance(x, Tensor):
        return x.detach().to(_F64).reshape(())
    return torch.tensor(float(x), dtype=_F64)


class Metric:
    """One metric's statistics. Subclasses define the kind, the merge and the rank-reduction slots."""

    kind: Kind

    def merge(self, other: Metric) -> Metric:
        raise NotImplementedError

    def empty(self) -> Metric:
        """The identity of `merge` with this metric's structure."""
        raise NotImplementedError

    def value(self) -> float | None:
        """The finalised number, or None when undefined (the key is then absent)."""
        raise NotImplementedError

    def slots(self) -> tuple[tuple[str, Tensor], ...]:
        """(reduce op, stat) pairs for the rank reduction; op is 'sum', 'min' or 'max'."""
        raise NotImplementedError

    def from_slots(self, stats: list[Tensor]) -> Metric:
        """The same structure rebuilt from reduced stats, in the order of `slots`."""
        raise NotImplementedError

    def close(self) -> Metric:
        """The metric once its mini-batch is sealed (only LOSS changes)."""
        return self

    def _check(self, other: Metric) -> None:
        if type(other) is not type(self):
            raise ValueError(f"cannot merge a {type(self).__name__} metric with a {type(other).__name__} metric")


@dataclass(frozen=True, eq=False)
class Sum(Metric):
    """A count or another additive quantity."""

    total: Tensor
    kind = Kind.SUM

    def __init__(self, total: Tensor | float | int = 0.0):
        object.__setattr__(self, "total", _stat(total))

    def merge(self, other):
        self._check(other)
        return Sum(self.total + other.total.to(self.total.device))

    def empty(self):
        return Sum(0.0)

    def value(self):
        return float(self.total)

    def slots(self):
        return (("sum", self.total),)

    def from_slots(self, stats):
        return Sum(stats[0])


@dataclass(frozen=True, eq=False)
class Mean(Metric):
    """A pooled mean: total / count, with the weighting chosen by the producer."""

    total: Tensor
    count: Tensor
    kind = Kind.MEAN

    def __init__(self, total: Tensor | float = 0.0, count: Tensor | float = 0.0):
        object.__setattr__(self, "total", _stat(total))
        object.__setattr__(self, "count", _stat(count))

    @staticmethod
    def of(values: Tensor, valid: Tensor) -> Mean:
        """Token-weighted mean of `values` over the positions where `valid` is true."""
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        return Mean(torch.where(valid, values.detach(), zero).sum(), valid.sum())

    def merge(self, other):
        self._check(other)
        dev = self.total.device
        return Mean(self.total + other.total.to(dev), self.count + other.count.to(dev))

    def empty(self):
        return Mean()

    def value(self):
        count = float(self.count)
        return float(self.total) / count if count > 0 else None

    def slots(self):
        return (("sum", self.total), ("sum", self.count))

    def from_slots(self, stats):
        return Mean(stats[0], stats[1])


@dataclass(frozen=True, eq=False)
class Min(Metric):
    """The smallest valid element; +inf while empty."""

    extreme: Tensor
    kind = Kind.MIN

    def __init__(self, extreme: Tensor | float = math.inf):
        object.__setattr__(self, "extreme", _stat(extreme))

    @staticmethod
    def of(values: Tensor, valid: Tensor) -> Min:
        if values.numel() == 0:
            return Min()
        inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
        return Min(torch.where(valid, values.detach(), inf).amin())

    def merge(self, other):
        self._check(other)
        return Min(torch.minimum(self.extreme, other.extreme.to(self.extreme.device)))

    def empty(self):
        return Min()

    def value(self):
        v = float(self.extreme)
        return v if math.isfinite(v) else None

    def slots(self):
        return (("min", self.extreme),)

    def from_slots(self, stats):
        return Min(stats[0])


@dataclass(frozen=True, eq=False)
class Max(Metric):
    """The largest valid element; -inf while empty."""

    extreme: Tensor
    kind = Kind.MAX

    def __init__(self, extreme: Tensor | float = -math.inf):
        object.__setattr__(self, "extreme", _stat(extreme))

    @staticmethod
    def of(values: Tensor, valid: Tensor) -> Max:
        if values.numel() == 0:
            return Max()
        ninf = torch.tensor(-math.inf, dtype=values.dtype, device=values.device)
        return Max(torch.where(valid, values.detach(), ninf).amax())

    def merge(self, other):
        self._check(other)
        return Max(torch.maximum(self.extreme, other.extreme.to(self.extreme.device)))

    def empty(self):
        return Max()

    def value(self):
        v = float(self.extreme)
        return v if math.isfinite(v) else None

    def slots(self):
        return (("max", self.extreme),)

    def from_slots(self, stats):
        return Max(stats[0])


@dataclass(frozen=True, eq=False)
class Loss(Metric):
    """A part of a mini-batch's scalar loss (logged without the dp factor).

    `total` sums the parts of open mini-batches and the closed mini-batches' values; `num_minibatches` counts the
    closed ones. Open (count 0) parts of one mini-batch add; closed mini-batches average: value = total / count.
    """

    total: Tensor
    num_minibatches: Tensor
    kind = Kind.LOSS

    def __init__(self, total: Tensor | float = 0.0, num_minibatches: Tensor | float = 0.0):
        object.__setattr__(self, "total", _stat(total))
        object.__setattr__(self, "num_minibatches", _stat(num_minibatches))

    def merge(self, other):
        self._check(other)
        dev = self.total.device
        return Loss(self.total + other.total.to(dev), self.num_minibatches + other.num_minibatches.to(dev))

    def empty(self):
        return Loss()

    def close(self):
        return Loss(self.total, torch.clamp(self.num_minibatches, min=1.0))

    def value(self):
        return float(self.total) / max(float(self.num_minibatches), 1.0)

    def slots(self):
        return (("sum", self.total), ("max", self.num_minibatches))

    def from_slots(self, stats):
        return Loss(stats[0], stats[1])


@dataclass(frozen=True, eq=False)
class Derived(Metric):
    """Additive sufficient statistics `stats` [k] and a pure function of them evaluated at `finalize`."""

    stats: Tensor
    formula: Callable[[list[float]], float | None]
    kind = Kind.DERIVED

    def __init__(self, stats: Tensor | Iterable[float | Tensor], formula: Callable[[list[float]], float | None]):
        if not isinstance(stats, Tensor):
            stats = torch.stack([_stat(s) for s in stats])
        object.__setattr__(self, "stats", stats.detach().to(_F64).reshape(-1))
        object.__setattr__(self, "formula", formula)

    def merge(self, other):
        self._check(other)
        if other.formula is not self.formula or other.stats.shape != self.stats.shape:
            raise ValueError("cannot merge DERIVED metrics with different formulas")
        return Derived(self.stats + other.stats.to(self.stats.device), self.formula)

    def empty(self):
        return Derived(torch.zeros_like(self.stats, device="cpu"), self.formula)

    def value(self):
        return self.formula(self.stats.tolist())

    def slots(self):
        return tuple(("sum", s) for s in self.stats.unbind())

    def from_slots(self, stats):
        return Derived(torch.stack(stats), self.formula)


@dataclass(frozen=True, eq=False)
class Diagnostic(Metric):
    """A fact about how the work ran; reduces like `inner`, never compared across layouts."""

    inner: Metric
    kind = Kind.DIAGNOSTIC

    def merge(self, other):
        self._check(other)
        return Diagnostic(self.inner.merge(other.inner))

    def empty(self):
        return Diagnostic(self.inner.empty())

    def close(self):
        return Diagnostic(self.inner.close())

    def value(self):
        return self.inner.value()

    def slots(self):
        return self.inner.slots()

    def from_slots(self, stats):
        return Diagnostic(self.inner.from_slots(stats))


def explained_variance(stats: list[float]) -> float | None:
    """1 - Var(r - v) / Var(r) from [sum r, sum r^2, sum (r - v), sum (r - v)^2, count]; None if Var(r) = 0."""
    sum_r, sum_r2, sum_d, sum_d2, count = stats
    if count <= 0:
        return None
    var_r = sum_r2 / count - (sum_r / count) ** 2
    var_d = sum_d2 / count - (sum_d / count) ** 2
    if var_r <= 0.0:
        return None
    return 1.0 - var_d / var_r


def std_from_moments(stats: list[float]) -> float | None:
    """Population std from [sum x, sum x^2, count]; None when empty."""
    sum_x, sum_x2, count = stats
    if count <= 0:
        return None
    return math.sqrt(max(sum_x2 / count - (sum_x / count) ** 2, 0.0))


class Metrics(Mapping[str, Metric]):
    """An immutable collection name -> Metric."""

    def __init__(self, items: Mapping[str, Metric] | Iterable[tuple[str, Metric]] = ()):
        self._items: dict[str, Metric] = dict(items)
        for name, metric in self._items.items():
            if not isinstance(metric, Metric):
                raise ValueError(f"metric {name!r} is a {type(metric).__name__}, not a typed Metric")

    def __getitem__(self, name: str) -> Metric:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Metrics({self._items!r})"

    def merge(self, other: Mapping[str, Metric]) -> Metrics:
        return merge(self, other)

    def prefixed(self, prefix: str) -> Metrics:
        """The same metrics with `prefix` prepended to every name (e.g. 'actor/')."""
        return Metrics((prefix + name, metric) for name, metric in self._items.items())


def merge(a: Mapping[str, Metric], b: Mapping[str, Metric]) -> Metrics:
    """Union of two collections; a name present in both merges by its kind (the kinds must agree)."""
    out = dict(a)
    for name, metric in b.items():
        out[name] = out[name].merge(metric) if name in out else metric
    return Metrics(out)


def merge_all(collections: Iterable[Mapping[str, Metric]]) -> Metrics:
    out = Metrics()
    for c in collections:
        out = merge(out, c)
    return out


def close_minibatch(collection: Mapping[str, Metric]) -> Metrics:
    """Seal one mini-batch: its LOSS parts become one mini-batch value, to be averaged with other mini-batches."""
    return Metrics((name, metric.close()) for name, metric in collection.items())


def finalize(collection: Mapping[str, Metric]) -> dict[str, float]:
    """Numbers to log; undefined ones (empty extrema, empty means, undefined DERIVED) are left out."""
    out = {}
    for name, metric in collection.items():
        v = metric.value()
        if v is not None:
            out[name] = v
    return out


def comparable(collection: Mapping[str, Metric]) -> dict[str, Kind]:
    """Names and kinds of the metrics that must agree across layouts: every kind but DIAGNOSTIC."""
    return {name: m.kind for name, m in collection.items() if m.kind is not Kind.DIAGNOSTIC}


# ---- the rank reduction -------------------------------------------------------------------------------------




_PLAIN_KINDS = {cls.__name__: cls for cls in (Sum, Mean, Min, Max)}


def to_plain(collection: Mapping[str, Metric]) -> dict[str, list]:
    """``collection`` as plain data (a checkpoint's): name -> [kind, its slots' values]. Only the kinds whose
    slots say everything (SUM, MEAN, MIN, MAX) can be written so; another kind is a ValueError."""
    plain = {}
    for name, metric in collection.items():
        if type(metric).__name__ not in _PLAIN_KINDS:
            raise ValueError(f"metric {name!r} is a {type(metric).__name__}, which has no plain form")
        plain[name] = [type(metric).__name__, [float(stat) for _, stat in metric.slots()]]
    return plain


def from_plain(plain: Mapping[str, list]) -> Metrics:
    """The inverse of :func:`to_plain`."""
    return Metrics({name: _PLAIN_KINDS[kind]().from_slots([_stat(v) for v in values])
                    for name, (kind, values) in plain.items()})
