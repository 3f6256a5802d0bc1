"""check-metrics for a mixture-of-experts policy (docs/moe.md): the load-balancing loss and the MoE metrics of the
one-sequence-at-a-time reference, computed from `fsdptrain.rl.moe_aux_loss`'s functions directly (never through
the train step's `fsdptrain.train.pack_losses`, whose token weights and shares are what the layouts check).

Each sequence runs alone through the unpacked model (sdpa, the forward of :mod:`fsdptrain.check.per_sequence`) inside
`fsdptrain.model.moe.routing`; every one of its tokens counts once (an unpacked sequence has no padding)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fsdptrain.check.per_sequence import route_layers, sequence_moe_terms, sequence_outputs
from fsdptrain.model.moe import Routes
from fsdptrain.rl.moe_aux_loss import LOAD_FORMULAS, MoeNormalizers, local_expert_counts, probability_sums
from fsdptrain.train.step import MiniBatch


def reference_moe_norms(model, batch: MiniBatch, coef: float) -> MoeNormalizers:
    """The load-balancing counts of ``batch`` (every token of every sequence, each sequence's own forward; counted
    with ``coef`` 0 too: the load metrics read them)."""
    counts_LE, num_tokens = None, 0
    for prompt_ids, response_ids in zip(batch.prompts, batch.responses):
        with torch.no_grad():
            _, _, routes = sequence_outputs(model, prompt_ids, response_ids, temperature=1.0, record=True)
        logits, indices = route_layers(routes)
        length = len(prompt_ids) + len(response_ids)
        local = local_expert_counts(indices, torch.ones(length), logits[0].shape[-1])
        counts_LE = local if counts_LE is None else counts_LE + local
        num_tokens += length
    return MoeNormalizers(coef=coef, expert_counts_LE=counts_LE.cpu(), num_tokens=num_tokens)


class DirectMoe:
    """The reference's MoE metrics computed directly: the probability sums S_e of the sequences (added as they
    run) against the batch's counts, ``aux = E sum_e (C_e / (L N)) (S_e / (L N))``, and each layer's load from
    its counts."""

    def __init__(self, norms: Optional[MoeNormalizers]):
        self.norms = norms
        self.sums_E: Optional[Tensor] = None

    def share(self, routes: Routes) -> Optional[Tensor]:
        """``coef`` x one sequence's share of the load-balancing loss (`sequence_moe_terms`), its probability sums
        added; None for a dense policy (no ``norms``)."""
        if self.norms is None:
            return None
        self.add(routes)
        return sequence_moe_terms(routes, self.norms)[0]

    def add(self, routes: Routes) -> None:
        logits, _ = route_layers(routes)
        sums = probability_sums([x.detach() for x in logits], torch.ones(logits[0].shape[0])).double().cpu()
        self.sums_E = sums if self.sums_E is None else self.sums_E + sums

    def metrics(self) -> dict[str, float]:
        if self.norms is None:
            return {}
        counts_LE = self.norms.expert_counts_LE
        num_layers, num_experts = counts_LE.shape
        scale = float(num_layers * self.norms.num_tokens)
        out = {}
        if self.norms.trains:
            out["moe/aux_loss"] = float(num_experts * ((counts_LE.sum(0) / scale) * (self.sums_E / scale)).sum())
        for layer, counts_E in enumerate(counts_LE.tolist()):
            for name, formula in LOAD_FORMULAS.items():
                value = formula(counts_E)
                if value is not None:
                    out[f"moe/layer_{layer}/{name}"] = value
        return out
