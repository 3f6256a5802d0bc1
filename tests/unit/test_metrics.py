"""Typed metrics: merging by kind, mini-batch closing, the rank reduction, finalize."""

import math

import pytest
import torch

from fsdptrain.metrics.buffers import ReduceBuffers, Schema, flatten, unflatten
from fsdptrain.metrics.typed import (
    Derived,
    Diagnostic,
    Kind,
    Loss,
    Max,
    Mean,
    Metrics,
    Min,
    Sum,
    close_minibatch,
    comparable,
    explained_variance,
    finalize,
    merge,
    merge_all,
    std_from_moments,
)


def test_loss_sums_within_a_minibatch_and_averages_over_minibatches():
    # mini-batch 1: micro-batches 1.0 + 2.0 = 3.0; mini-batch 2: 5.0 -> logged (3 + 5) / 2 = 4, never 8
    mb1 = close_minibatch(merge(Metrics({"pg_loss": Loss(1.0)}), Metrics({"pg_loss": Loss(2.0)})))
    mb2 = close_minibatch(Metrics({"pg_loss": Loss(5.0)}))
    assert finalize(mb1)["pg_loss"] == 3.0
    assert finalize(merge(mb1, mb2))["pg_loss"] == 4.0
    # epochs: a third mini-batch (another epoch) of 1.0 -> (3 + 5 + 1) / 3 = 3
    assert finalize(merge_all([mb1, mb2, close_minibatch(Metrics({"pg_loss": Loss(1.0)}))]))["pg_loss"] == 3.0


def test_sum_counts_add_everywhere():
    mb1 = close_minibatch(merge(Metrics({"num_tokens": Sum(3)}), Metrics({"num_tokens": Sum(4)})))
    mb2 = close_minibatch(Metrics({"num_tokens": Sum(10)}))
    assert finalize(merge(mb1, mb2))["num_tokens"] == 17.0


def test_mean_pools():
    # entropy over 3 tokens totalling 6 and over 1 token of 1: (6 + 1) / 4, not the mean of means (2 + 1) / 2
    m = merge(Metrics({"entropy": Mean(6.0, 3)}), Metrics({"entropy": Mean(1.0, 1)}))
    assert finalize(close_minibatch(m))["entropy"] == 1.75
    assert Mean.of(torch.tensor([1.0, 2.0, 100.0]), torch.tensor([True, True, False])).value() == 1.5


def test_extrema_identity_and_absence():
    assert finalize(merge(Metrics({"v_min": Min()}), Metrics({"v_min": Min(3.0)}))) == {"v_min": 3.0}
    assert finalize(merge(Metrics({"v_max": Max(-2.0)}), Metrics({"v_max": Max()}))) == {"v_max": -2.0}
    assert finalize(Metrics({"v_min": Min(), "v_max": Max(), "m": Mean()})) == {}
    # fully masked elements never contribute
    assert Min.of(torch.tensor([5.0, -7.0]), torch.tensor([True, False])).value() == 5.0
    assert Max.of(torch.zeros(0), torch.zeros(0, dtype=torch.bool)).value() is None


def test_reduction_follows_kind_not_name():
    # A MAX metric whose name ends in _min is still a max; a SUM named *_mean still adds.
    a = Metrics({"odd_min": Max(1.0), "odd_mean": Sum(2.0)})
    c = merge(a, Metrics({"odd_min": Max(4.0), "odd_mean": Sum(3.0)}))
    assert finalize(c) == {"odd_min": 4.0, "odd_mean": 5.0}


def test_merging_different_kinds_is_refused():
    with pytest.raises(ValueError, match="cannot merge"):
        merge(Metrics({"x": Sum(1.0)}), Metrics({"x": Mean(1.0, 1)}))
    with pytest.raises(ValueError, match="typed Metric"):
        Metrics({"x": 1.0})


def test_derived_explained_variance_is_exact_under_any_split():
    r = torch.tensor([2.0, 0.0, 3.5, 1.0, -1.0], dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 3.0, 1.5, 0.0], dtype=torch.float64)

    def ev(idx):
        rr, d = r[idx], (r - v)[idx]
        return Metrics({"ev": Derived([rr.sum(), rr.square().sum(), d.sum(), d.square().sum(), len(idx)],
                                      explained_variance)})

    whole = finalize(ev([0, 1, 2, 3, 4]))["ev"]
    split = finalize(merge_all([ev([0]), ev([1, 2]), ev([3, 4])]))["ev"]
    expected = 1 - torch.var(r - v, unbiased=False).item() / torch.var(r, unbiased=False).item()
    assert whole == pytest.approx(expected, abs=1e-12) and split == pytest.approx(expected, abs=1e-12)
    # a constant r has no variance to explain: absent
    assert finalize(ev([2])) == {}
    # std from moments of [1, 2, 3]: sqrt(14/3 - 4) = sqrt(2/3)
    assert Derived([6.0, 14.0, 3.0], std_from_moments).value() == pytest.approx(math.sqrt(2 / 3))


def test_diagnostic_reduces_like_inner_and_is_not_comparable():
    a = Metrics({"fill": Diagnostic(Mean(3.0, 4.0)), "pg_loss": Loss(1.0), "n": Sum(2)})
    b = Metrics({"fill": Diagnostic(Mean(1.0, 4.0)), "pg_loss": Loss(1.0), "n": Sum(2)})
    c = merge(a, b)
    assert finalize(c)["fill"] == 0.5
    assert comparable(c) == {"pg_loss": Kind.LOSS, "n": Kind.SUM}
    assert c["fill"].kind is Kind.DIAGNOSTIC


def _pack_metrics(losses, values, counts):
    return Metrics({
        "pg_loss": Loss(losses),
        "entropy": Mean(values, counts),
        "num_tokens": Sum(counts),
        "values_min": Min(values) if counts else Min(),
        "values_max": Max(values) if counts else Max(),
        "ev": Derived([values, counts], _mean_of_pair),
        "timer": Diagnostic(Max(counts)),
    })


def _mean_of_pair(stats):
    return stats[0] / stats[1] if stats[1] else None


def _all_reduce(buffers: list[ReduceBuffers]) -> ReduceBuffers:
    """What the trainer's three all_reduce calls compute, simulated over ranks."""
    return ReduceBuffers(
        torch.stack([b.sum for b in buffers]).sum(0),
        torch.stack([b.min for b in buffers]).amin(0),
        torch.stack([b.max for b in buffers]).amax(0),
    )


def test_rank_reduction_matches_single_process_merge():
    ranks = [
        [_pack_metrics(1.0, 4.0, 2.0), _pack_metrics(0.5, -1.0, 1.0)],
        [_pack_metrics(0.25, 7.0, 3.0)],
        [Metrics({"pg_loss": Loss(0.0), "timer": Diagnostic(Max(9.0))})],  # an empty pack lacking keys
    ]
    local = [merge_all(packs) for packs in ranks]
    schema = Schema.of(*local)
    assert list(schema) == sorted(schema)
    assert len({Schema.of(*local[::-1]).fingerprint(), schema.fingerprint()}) == 1
    reduced = unflatten(_all_reduce([flatten(c, schema) for c in local]), schema)
    reference = merge_all(local)
    assert finalize(reduced) == pytest.approx(finalize(reference))
    assert finalize(reduced)["values_min"] == -1.0 and finalize(reduced)["values_max"] == 7.0
    assert finalize(reduced)["pg_loss"] == 1.75


def test_rank_reduction_after_closing_minibatches():
    # 2 ranks x 2 mini-batches. Per mini-batch the global pg_loss is rank0 + rank1: mb1 = 1 + 2, mb2 = 3 + 6.
    # Logged: (3 + 9) / 2 = 6, whether ranks are reduced per mini-batch or once after closing both.
    per_rank = {0: [1.0, 3.0], 1: [2.0, 6.0]}
    late = [merge_all(close_minibatch(Metrics({"pg_loss": Loss(x)})) for x in per_rank[r]) for r in (0, 1)]
    schema = Schema.of(*late)
    reduced = unflatten(_all_reduce([flatten(c, schema) for c in late]), schema)
    assert finalize(reduced)["pg_loss"] == 6.0
    early = []
    for mb in (0, 1):
        ranks = [Metrics({"pg_loss": Loss(per_rank[r][mb])}) for r in (0, 1)]
        early.append(close_minibatch(unflatten(_all_reduce([flatten(c, schema) for c in ranks]), schema)))
    assert finalize(merge_all(early))["pg_loss"] == 6.0


def test_flatten_refuses_names_outside_the_schema_and_kind_mismatch():
    schema = Schema.of(Metrics({"a": Sum(1)}))
    with pytest.raises(ValueError, match="not in the schema"):
        flatten(Metrics({"b": Sum(1)}), schema)
    with pytest.raises(ValueError, match="does not match the schema"):
        flatten(Metrics({"a": Mean(1, 1)}), schema)
    assert Schema.of(Metrics({"a": Sum(1)})).fingerprint() != Schema.of(Metrics({"a": Mean(1, 1)})).fingerprint()


def test_finalize_never_emits_nonfinite():
    c = Metrics({"a": Min(), "b": Max(), "c": Mean(0.0, 0.0), "d": Loss(), "e": Sum(0)})
    out = finalize(close_minibatch(c))
    assert out == {"d": 0.0, "e": 0.0}


def test_prefixed():
    assert list(Metrics({"pg_loss": Loss(1.0)}).prefixed("actor/")) == ["actor/pg_loss"]
