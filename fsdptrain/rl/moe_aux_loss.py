"""The load-balancing loss of mixture-of-experts routers, defined once over a global batch (docs/moe.md), and the
expert-load metrics. Pure numerics: the global counts arrive as arguments (docs/architecture.md, "Mixture of
experts"); nothing here reduces across ranks.

Legend: L MoE layers, E experts per layer, k experts chosen per token; `_T` the tokens of one forward (a packed row,
or a padded batch flattened), `_TE` `[T, E]`, `_Tk` `[T, k]`, `_LE` `[L, E]`. A token's weight ``w_t`` is how many
tokens of the batch it stands for: 1 for a real token, 0 for padding (the padded layout's mask, a packed row's
tail), n for a prompt token a shared-prompt row holds once for n sequences.

transformers' definition (``load_balancing_loss_func`` of Qwen3-MoE, Mixtral and OLMoE; Switch Transformer eqs. 4-6),
over the N tokens of one forward (N = sum_t w_t) and its L MoE layers, with ``p_lt = softmax(logits_lt)``:

    C_e = sum_l sum_t w_t #{j : idx_ltj = e}      top-k selections of expert e, pooled over the layers
    S_e = sum_l sum_t w_t p_lte                   router probability of expert e, pooled over the layers
    aux = E * sum_e (C_e / (L N)) * (S_e / (L N))

A perfectly balanced router gives ``aux = k`` (C_e = k L N / E, S_e = L N / E); transformers pools expert e of every
layer into one count and so does this module, so the model config's ``router_aux_loss_coef`` means here what it
means in transformers (tested against transformers' function: tests/unit/test_moe_aux_loss.py).

Why it must be global: computed per forward, C and S are means over that forward's tokens, and a product of two means
is not a mean: averaging per-micro-batch (or per-pack, per-rank) values changes the value and the gradient with the
layout. Here C and N are the mini-batch's, summed over every micro-batch and rank before the first forward
(``C`` carries no gradient: it counts top-k indices). The loss is then linear in the router probabilities,

    aux = sum over packs  E / (L N)^2 * sum_e C_e * S_e^pack,

so each pack's share (:func:`aux_loss_share`) is exact under any packing, micro-batching and number of ranks, value
and gradient. Like `fsdptrain.rl.aggregate.agg_loss`, each share is multiplied by the data-parallel size, because
FSDP averages gradients over the ranks. Departures from transformers: none in value; the counts are the mini-batch's
instead of one forward's, which is the point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from fsdptrain.metrics.typed import Derived, Loss, Metrics


@dataclass(frozen=True)
class MoeNormalizers:
    """The load-balancing loss's global counts for one mini-batch, and its weight in the policy loss.

    ``coef``: the weight (``model.moe.aux_loss_coef`` resolved; 0 trains no load-balancing loss and only the metrics
    are kept); ``expert_counts_LE``: float64 ``[L, E]``, the top-k selections C_le of the mini-batch's counted tokens
    (over every micro-batch and rank), None when ``coef`` is 0; ``num_tokens``: N, the counted tokens."""

    coef: float
    expert_counts_LE: Tensor | None = None
    num_tokens: int = 0

    def __post_init__(self):
        if self.coef < 0:
            raise ValueError(f"the load-balancing loss coefficient must be >= 0, got {self.coef}")
        if self.coef > 0 and self.expert_counts_LE is None:
            raise ValueError("a load-balancing loss with coef > 0 needs the mini-batch's expert counts")

    @property
    def trains(self) -> bool:
        """Whether a load-balancing loss is added (coef > 0)."""
        return self.coef > 0


def local_expert_counts(indices_LTk: Sequence[Tensor], weights_T: Tensor, num_experts: int) -> Tensor:
    """float64 ``[L, E]``: ``sum_t w_t #{j : idx_ltj = e}`` per layer, the routes ``indices_LTk`` of one forward
    (one ``[T, k]`` tensor per MoE layer) weighted by ``weights_T``. No gradient (indices)."""
    weights_T = weights_T.to(torch.float64)
    rows = []
    for indices_Tk in indices_LTk:
        counts = torch.zeros(num_experts, dtype=torch.float64, device=indices_Tk.device)
        k = indices_Tk.shape[-1]
        rows.append(counts.index_add_(0, indices_Tk.reshape(-1).long(),
                                      weights_T.to(indices_Tk.device).repeat_interleave(k)))
    return torch.stack(rows)


def probability_sums(logits_LTE: Sequence[Tensor], weights_T: Tensor) -> Tensor:
    """``[E]`` float32 (or wider): ``S_e = sum_l sum_t w_t softmax(logits_lt)_e`` of one forward, differentiable in the
    logits. A token of weight 0 contributes an exact 0 to the value and the gradient, whatever its (finite) logits."""
    total = None
    for logits_TE in logits_LTE:
        probs_TE = torch.softmax(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)), dim=-1)
        w = weights_T.to(device=probs_TE.device, dtype=probs_TE.dtype).unsqueeze(-1)
        layer = torch.where(w != 0, probs_TE * w, torch.zeros((), dtype=probs_TE.dtype, device=probs_TE.device))
        total = layer.sum(0) if total is None else total + layer.sum(0)
    return total


def aux_loss_share(logits_LTE: Sequence[Tensor], weights_T: Tensor, norms: MoeNormalizers, *,
                   dp_size: int = 1) -> Tensor:
    """One forward's share of the mini-batch's load-balancing loss (without ``coef``), dp factor included:

        share = E / (L N)^2 * sum_e C_e * S_e^forward * dp_size

    ``C`` and ``N`` from ``norms`` (the mini-batch's), ``S`` of this forward (:func:`probability_sums`). The shares of
    all forwards of a mini-batch, averaged over ranks, sum to transformers' aux of the whole mini-batch in one
    forward. 0 when N is 0 (nothing counted anywhere)."""
    counts_LE = norms.expert_counts_LE
    num_layers, num_experts = counts_LE.shape
    sums_E = probability_sums(logits_LTE, weights_T)
    if norms.num_tokens == 0:
        return sums_E.sum() * 0.0
    counts_E = counts_LE.sum(0).to(device=sums_E.device, dtype=sums_E.dtype)
    return num_experts * (counts_E * sums_E).sum() / float(num_layers * norms.num_tokens) ** 2 * dp_size


def whole_batch_aux_loss(logits_LTE: Sequence[Tensor], indices_LTk: Sequence[Tensor], weights_T: Tensor) -> Tensor:
    """transformers' value on ONE forward's own tokens: its C, S and N only (the reference the global definition is
    tested against; per micro-batch it is the layout-dependent quantity the global loss replaces)."""
    num_experts = logits_LTE[0].shape[-1]
    counts_LE = local_expert_counts(indices_LTk, weights_T, num_experts)
    norms = MoeNormalizers(coef=1.0, expert_counts_LE=counts_LE, num_tokens=int(weights_T.sum()))
    return aux_loss_share(logits_LTE, weights_T, norms)


# ---- metrics -------------------------------------------------------------------------------------------------------


def _share(extreme: Callable[[list[float]], float]) -> Callable[[list[float]], float | None]:
    def formula(counts: list[float]) -> float | None:
        total = sum(counts)
        return extreme(counts) / total if total > 0 else None
    return formula


def load_cv(counts: list[float]) -> float | None:
    """Coefficient of variation of an expert-count vector: std / mean over the experts (0: perfectly balanced;
    sqrt(E - 1): every token on one expert); None when nothing was routed."""
    total = sum(counts)
    if total <= 0:
        return None
    mean = total / len(counts)
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean


LOAD_FORMULAS: dict[str, Callable[[list[float]], float | None]] = {
    "load_max_share": _share(max), "load_min_share": _share(min), "load_cv": load_cv}
"""The per-layer load metrics, each a function of the layer's global expert counts (docs/moe.md, "Metrics")."""


def moe_metrics(counts_LE: Tensor, aux_share: Tensor | None, *, dp_size: int = 1) -> Metrics:
    """The typed metrics of one forward: per layer l, ``moe/layer_<l>/load_max_share``, ``load_min_share`` (the
    most and least loaded expert's share of the layer's top-k selections) and ``load_cv`` (std / mean of the
    counts), each DERIVED from the counts ``counts_LE`` (additive: exact under any split, over the step's update
    forwards); and, when a loss is trained, ``moe/aux_loss`` (LOSS: this forward's share without the dp factor;
    its mini-batch value is the global aux, averaged over mini-batches and epochs)."""
    out = {}
    for layer, counts_E in enumerate(counts_LE.detach().to(torch.float64)):
        for name, formula in LOAD_FORMULAS.items():
            out[f"moe/layer_{layer}/{name}"] = Derived(counts_E, formula)
    if aux_share is not None:
        out["moe/aux_loss"] = Loss(aux_share.detach() / dp_size)
    return Metrics(out)
