"""The experts each mixture-of-experts layer chose while tokens were drawn, recorded for routing replay
(docs/moe.md, "Routing replay"; the seam: fsdptrain/model/moe.py).

An engine that records runs its model calls inside :meth:`RouteTape.recording` (one ``routing(record=True)`` block
for the whole decode) and, after each forward, takes that forward's routes as ``[L, rows, columns, k]`` small ints
(:meth:`RouteTape.take`: the routers see the batch's ``[rows, columns]`` tokens flattened row-major), then hands
each request the slices of the tokens it fed. A request's record (``Generated.routes``) covers the tokens its
forwards read: its ``new_ids``, then every sampled id but the last (which no forward reads); the follow-up turn's
``new_ids`` begin with that last id, so a trajectory's turns concatenate to every position of prompt + response but
the last.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from fsdptrain.model.moe import moe_layers, route_dtype, routing


def records_routes(model, mode: str) -> bool:
    """Whether a decoder records routes: a mixture-of-experts policy sampling training rollouts
    (``mode == "train"``), in the trainer's processes or on a generator rank (``rollout.placement=separate``: the
    routes travel with the samples it sends, docs/routing-replay.md)."""
    return mode == "train" and bool(moe_layers(model))


class RouteTape:
    """Each forward's routes of ``model`` inside :meth:`recording`; see the module docstring."""

    def __init__(self, model):
        self.model = model
        layers = moe_layers(model)
        self.num_layers = len(layers)
        self.dtype = route_dtype(max(layer.num_experts for layer in layers))
        self._routes = None

    @contextlib.contextmanager
    def recording(self) -> Iterator["RouteTape"]:
        with routing(self.model, record=True) as routes:
            self._routes = routes
            try:
                yield self
            finally:
                self._routes = None

    def take(self, rows: int, columns: int) -> Tensor:
        """The last forward's routes, ``[L, rows, columns, k]`` in :func:`route_dtype`; the record is cleared (its
        router logits are not kept)."""
        routes = self._routes
        indices = routes.stacked_indices()
        routes.logits.clear()
        routes.indices.clear()
        return indices.to(self.dtype).view(self.num_layers, rows, columns, -1)


def joined(chunks: list[Tensor]) -> Optional[Tensor]:
    """A request's route chunks (``[L, n_i, k]`` each, in the order its tokens were fed) as one ``[L, n, k]`` tensor
    on the CPU; None for no chunk."""
    if not chunks:
        return None
    return torch.cat(chunks, dim=1).cpu()
