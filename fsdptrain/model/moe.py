"""Mixture-of-experts layers of a transformers model, and the one seam through which fsdptrain sees and steers their
routing (docs/moe.md, docs/architecture.md "Mixture of experts").

transformers' MoE decoders (Qwen3-MoE, Mixtral, OLMoE) share one shape: each sparse block holds a router ``gate``
(``forward(hidden [T, H]) -> (logits [T, E], scores [T, k], indices [T, k])``) and an ``experts`` module
(``forward(hidden [T, H], indices [T, k], scores [T, k]) -> [T, H]``, expert weights stacked ``[E, ...]``).
:func:`moe_layers` finds them; :func:`routing` is a context in which every router's output passes through one
forward hook that records what it chose and, when given routes to replay, replaces its choice.

Replay keeps the gate differentiable: the replayed ``indices`` are the recorded ones, the ``scores`` are the current
router's probabilities at those experts (:func:`replayed_scores`), so the router still learns through the weights it
gives the experts it is told to use.

A router runs once per layer per forward (twice with activation checkpointing: the recomputation sees the same
replayed routes, and the record keeps the last call), so the record and the replay are keyed by the layer's index
among the model's MoE layers, never by a call counter.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from fsdptrain.data.packing import OWN_ROUTE  # a replayed row of it keeps the router's own choice


@dataclass(frozen=True)
class MoeLayer:
    """One sparse block: its ``index`` among the model's MoE layers, its module ``name``, its ``router`` (``gate``)
    and ``experts`` modules, ``num_experts`` E, ``top_k`` k, and whether the top-k scores are renormalised to sum
    to 1 (``normalize``)."""

    index: int
    name: str
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int
    normalize: bool


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """The model's sparse blocks in forward order; [] for a dense model. A block is a module with a ``gate`` whose
    ``top_k`` and ``num_experts`` are set and an ``experts`` module."""
    out: list[MoeLayer] = []
    for name, module in model.named_modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if isinstance(gate, nn.Module) and isinstance(experts, nn.Module) \
                and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            # Mixtral's router always renormalises; the others say so in norm_topk_prob
            normalize = bool(getattr(gate, "norm_topk_prob", True))
            out.append(MoeLayer(len(out), name, gate, experts, int(gate.num_experts), int(gate.top_k), normalize))
    return out


def replayed_scores(logits_TE: Tensor, indices_Tk: Tensor, *, normalize: bool) -> Tensor:
    """The gate weights of replayed routes: ``p = softmax(logits)`` in float32, taken at ``indices``, renormalised
    over the k chosen when the router renormalises; differentiable in ``logits``, in the logits' dtype.

    With ``indices`` the router's own top-k this is exactly the router's own scores."""
    probs = torch.softmax(logits_TE.float(), dim=-1)
    top = probs.gather(-1, indices_Tk.long())
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits_TE.dtype)


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert indices ``0 .. num_experts - 1``: uint8 up to 256 experts,
    int16 beyond (the record kept with each sample, docs/moe.md "Routing replay")."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class Routes:
    """What the routers of one forward did, by layer index: ``logits[i]`` ``[T, E]`` (with their graph) and
    ``indices[i]`` ``[T, k]`` (int64). Filled by :func:`routing`; a layer's entry is its router's last call."""

    logits: dict[int, Tensor] = field(default_factory=dict)
    indices: dict[int, Tensor] = field(default_factory=dict)

    def stacked_indices(self) -> Tensor:
        """``[L, T, k]`` of the recorded indices, layers in order."""
        return torch.stack([self.indices[i] for i in sorted(self.indices)])


@contextmanager
def routing(model: nn.Module, *, record: bool = True,
            replay: Optional[Sequence[Tensor]] = None) -> Iterator[Routes]:
    """Inside the block every router of ``model`` records into the yielded :class:`Routes` (when ``record``), and
    with ``replay`` (one ``[T, k]`` index tensor per MoE layer, the tokens in the forward's order) routes each layer's
    tokens to the replayed experts with :func:`replayed_scores` (a row of :data:`OWN_ROUTE` keeps the router's own
    experts and scores). ``replay`` may be changed between forwards through
    the yielded object's ``replay`` attribute (set by this function) by callers that run several forwards."""
    layers = moe_layers(model)
    routes = Routes()
    routes.replay = list(replay) if replay is not None else None  # type: ignore[attr-defined]
    if replay is not None and len(replay) != len(layers):
        raise ValueError(f"routing replay holds {len(replay)} layers; the model has {len(layers)} MoE layers")

    def hook_of(layer: MoeLayer):
        def hook(_module, _inputs, output):
            logits, scores, indices = output
            wanted = routes.replay  # type: ignore[attr-defined]
            if wanted is not None:
                replayed = wanted[layer.index].to(device=indices.device, dtype=indices.dtype)
                if replayed.shape[0] != logits.shape[0]:
                    raise ValueError(f"routing replay of MoE layer {layer.index} holds {replayed.shape[0]} tokens; "
                                     f"the forward routes {logits.shape[0]}")
                # a row of -1 (OWN_ROUTE: a token no generating forward read) keeps the router's own choice
                own = (replayed == OWN_ROUTE).any(dim=-1, keepdim=True)
                replayed = torch.where(own, indices, replayed)
                scores = torch.where(own, scores,
                                     replayed_scores(logits, replayed, normalize=layer.normalize).to(scores.dtype))
                indices = replayed
            if record:
                routes.logits[layer.index] = logits
                routes.indices[layer.index] = indices.detach()
            return (logits, scores, indices) if wanted is not None else None
        return hook

    handles = [layer.router.register_forward_hook(hook_of(layer)) for layer in layers]
    try:
        yield routes
    finally:
        for handle in handles:
            handle.remove()
