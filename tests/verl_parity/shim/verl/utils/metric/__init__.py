"""verl.utils.metric: `reduce_metrics`, the mean of each list, by fsdptrain's MEAN metric (an empty list: NaN)."""

from __future__ import annotations

from verl.utils.metric.utils import Metric, reduce_metrics

__all__ = ["Metric", "reduce_metrics"]
