"""verl.utils.metric.utils: verl's list-of-values `Metric` and `AggregationType`; every aggregate is one of
fsdptrain's typed metrics (fsdptrain.metrics.typed Sum / Mean / Min / Max) merged over the values."""

from __future__ import annotations

import enum
import math

import torch

from fsdptrain.metrics.typed import Max, Mean, Min, Sum, merge_all


class AggregationType(enum.Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_FSDPTRAIN = {AggregationType.MEAN: lambda v: Mean(v, 1), AggregationType.SUM: Sum,
              AggregationType.MIN: Min, AggregationType.MAX: Max}


class Metric:
    def __init__(self, aggregation="mean", value=None):
        self.aggregation = AggregationType(aggregation) if not isinstance(aggregation, AggregationType) else aggregation
        self.values: list = []
        if value is not None:
            self.append(value)

    def append(self, value):
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"a metric value must be a scalar, got shape {tuple(value.shape)}")
            value = value.item()
        self.values.append(value)

    def extend(self, values):
        if isinstance(values, Metric):
            if values.aggregation is not self.aggregation:
                raise ValueError(f"cannot extend a {self.aggregation.value} metric with a "
                                 f"{values.aggregation.value} one")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self):
        make = _FSDPTRAIN[self.aggregation]
        merged = merge_all([{"m": make(v)} for v in self.values])
        value = merged["m"].value() if "m" in merged else None
        return math.nan if value is None else value

    @classmethod
    def chain(cls, metrics):
        out = cls(metrics[0].aggregation)
        for m in metrics:
            out.extend(m)
        return out

    @classmethod
    def from_dict(cls, data, aggregation="mean"):
        return {k: cls(aggregation, v) for k, v in data.items()}

    def init_list(self):
        return Metric(self.aggregation)


def reduce_metrics(metrics):
    out = {}
    for key, values in metrics.items():
        metric = values if isinstance(values, Metric) else Metric("mean")
        if not isinstance(values, Metric):
            metric.extend(values)
        out[key] = metric.aggregate()
    return out
