"""The collectives the train step agrees with: the world-agreed pack plan and the metric reduction by kind.

Both are collective (every rank calls them in the same order) and both exist so that every rank runs the same
forwards and reduces the same numbers: :func:`plan_agreed` gives every rank as many packs as the busiest rank needs
(FSDP's collectives line up; a rank with less work runs empty packs), and :func:`reduce_metrics` checks that every
rank holds the same metric schema before reducing the buffers by position (docs/metrics.md). The metric containers
come from ``fsdptrain.metrics.typed`` / ``fsdptrain.metrics.buffers``: the one part of ``rl/`` this package may import.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fsdptrain.config import ConfigError
from fsdptrain.data.packing import PackPlan, TokenIds, plan_packs
from fsdptrain.data.shared_prompts import expand_units, shared_prompt_units
from fsdptrain.distributed import world
from fsdptrain.metrics.buffers import Schema, describe, flatten, unflatten
from fsdptrain.metrics.typed import Metrics


def plan_agreed(lengths: Sequence[int], token_budget: int) -> PackPlan:
    """This rank's packs under the budget, with as many packs as the busiest rank needs (collective: one all-reduce).

    A sequence longer than the budget is the user's setting to fix: every rank learns of it through the same
    all-reduce and raises the same ConfigError, so the run ends with one line and exit 2, not a hang.
    """
    return _agreed(lengths, max(lengths, default=0), token_budget)


def plan_agreed_shared(prompts: Sequence[TokenIds], responses: Sequence[TokenIds], token_budget: int) -> PackPlan:
    """:func:`plan_agreed` for packs with shared prompts (collective): it plans the units of
    `fsdptrain.data.shared_prompts.shared_prompt_units` (a prompt's sequences as one unit of P + sum(R) tokens) and
    returns the plan over their sequences; a pack's token count is its units' shared count."""
    longest = max((len(p) + len(r) for p, r in zip(prompts, responses)), default=0)
    units, sizes = shared_prompt_units(prompts, responses, token_budget) if longest <= token_budget else ([], [])
    return expand_units(_agreed(sizes, longest, token_budget), units)


def _agreed(lengths: Sequence[int], longest: int, token_budget: int) -> PackPlan:
    """Plan `lengths` (the items to pack) with as many packs as the busiest rank needs; `longest` is this rank's
    longest sequence, checked against the budget on every rank at once."""
    plan = plan_packs(lengths, token_budget) if longest <= token_budget else None
    agreed = world.all_reduce_max(torch.tensor([longest, plan.num_packs if plan else 0], dtype=torch.float64))
    global_longest, num_packs = int(agreed[0]), int(agreed[1])
    if global_longest > token_budget:
        raise ConfigError(f"trainer.token_budget={token_budget} is smaller than a sequence of {global_longest} tokens "
                          f"(prompt + response): raise trainer.token_budget to at least {global_longest}")
    if num_packs != plan.num_packs:
        plan = plan_packs(lengths, token_budget, min_packs=num_packs)
    return plan


def reduce_metrics(metrics: Metrics) -> Metrics:
    """Merge metrics over all ranks by their kinds (collective): SUM/MEAN/LOSS/DERIVED add, MIN/MAX take extrema.

    The buffers are reduced by position, so every rank must hold the same metric names of the same kinds in the same
    order: one small all-reduce of the schema's fingerprint checks that first, and a mismatch is an error naming the
    metrics that differ (never numbers silently mixed).
    """
    schema = Schema.of(metrics)
    check_same_schema(schema)
    buffers = flatten(metrics, schema)
    reduced = type(buffers)(world.all_reduce_sum(buffers.sum), world.all_reduce_min(buffers.min),
                            world.all_reduce_max(buffers.max))
    return unflatten(reduced, schema)


def check_same_schema(schema: Schema) -> None:
    """Raise on every rank when the ranks' metric schemas differ (collective), naming the differing metrics."""
    fingerprint = float(schema.fingerprint())
    extremes = world.all_reduce_min(torch.tensor([fingerprint, -fingerprint], dtype=torch.float64))
    if extremes[0] == -extremes[1]:
        return
    described = world.all_gather_object({name: describe(m) for name, m in schema.items()})
    every = set().union(*described)
    differing = sorted(n for n in every if len({d.get(n) for d in described}) > 1)
    raise RuntimeError(f"the ranks hold different metrics, so reducing them by position would mix numbers: "
                       f"{', '.join(differing)} differ (present or of another kind) across the {len(described)} ranks")
