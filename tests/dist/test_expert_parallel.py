"""Expert parallelism (fsdptrain/distributed/expert_parallel.py) equals ep=1 on gloo: the loss, the reduced metrics,
the grad norm, every gathered gradient and every updated weight of the product's update (packed micro-batches, the
fused policy loss, global normalisers, a clipped AdamW step), with and without activation checkpointing; the experts
gathered for generation give ep=1's logits bit for bit; Mixtral's and OLMoE's experts split the same way (a
forward and backward). On 2 ranks each holds 2 of the 4 experts (dp = ep); on 4 the
2 ranks holding the same experts also shard them with FSDP2 and reduce among themselves (dp > ep).

Measured (fp32, CPU): 2 ranks: the loss, the metrics and the grad norm identical, gradients within 1.4e-9 and weights
within 3.8e-9 of the largest entry; 4 ranks: the loss and metrics within 1e-6 relative, gradients within 6.4e-8. A
missing division by dp on the experts' gradients, or a reduction over the EP group added to the all-to-all's, would
double them (error 1.0); a token sent to the wrong owner changes the logits at 1e-2.
"""

from __future__ import annotations

import math

import pytest

from tests.dist.launch import launch

TIGHT = 1e-7  # relative to the largest entry: fp32 sums taken in another order


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2-ep2", "dp4-ep2"])
def ranks(request, tmp_path_factory):
    nproc = request.param
    result = launch("expert_parallel_checks.py", nproc=nproc, out_dir=tmp_path_factory.mktemp(f"ep{nproc}"),
                    args=("--ep", "2"))
    records = result.checked(nproc, error_free=True).results
    return [records[rank]["results"] for rank in range(nproc)]


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_each_rank_holds_its_share_of_the_experts(ranks):
    for r in ranks:
        assert r["local_experts"] == [4 // 2 // (len(ranks) // 2), 32, 32]  # ep=2, then FSDP2 over the replicas


def test_loss_metrics_and_grad_norm_equal_ep1(ranks):
    for r in ranks:
        one, split, checkpointed = r["loss"]
        assert close(split, one) and close(checkpointed, one), r["loss"]
        assert close(r["grad_norm"][1], r["grad_norm"][0]) and close(r["grad_norm"][2], r["grad_norm"][0])
        metrics_one, metrics_split, metrics_checkpointed = r["metrics"]
        assert set(metrics_split) == set(metrics_one) == set(metrics_checkpointed)
        for name, value in metrics_one.items():
            assert close(metrics_split[name], value), (name, value, metrics_split[name])
            assert close(metrics_checkpointed[name], value), (name, value, metrics_checkpointed[name])


def test_every_gradient_and_weight_equals_ep1(ranks):
    for r in ranks:
        assert any(name.endswith("experts.gate_up_proj") for name in r["grad_names"])
        assert any(name.endswith("gate.weight") for name in r["grad_names"])
        assert r["grad_rel"] <= TIGHT, r["grad_rel"]
        assert r["grad_rel_checkpointed"] <= TIGHT, r["grad_rel_checkpointed"]
        assert r["weight_rel"] <= TIGHT, r["weight_rel"]
        # and both against the plain transformers model on the whole padded batch, at the dense models' tolerance
        assert r["grad_rel_reference"] <= 1e-5 and r["grad_rel_reference_ep1"] <= 1e-5


def test_forwards_equal_ep1_and_gathered_experts_are_exact(ranks):
    for r in ranks:
        assert r["dispatched_vs_ep1"] <= 1e-6
        assert r["gathered_vs_ep1"] == 0.0


@pytest.mark.parametrize("architecture", ["mixtral", "olmoe"])
def test_mixtral_and_olmoe_experts_split_the_same_way(ranks, architecture):
    for r in ranks:
        got = r["architectures"][architecture]
        assert close(got["loss"][1], got["loss"][0]), got
        assert got["grad_rel"] <= 1e-6, got  # measured <= 2e-7: this loss's gradients are small sums of many terms


def test_ranks_that_receive_or_send_nothing_under_both_implementations(ranks):
    for rank, r in enumerate(ranks):
        cases = r["empty_exchanges"]
        assert len(cases) == 4
        for implementation in ("grouped_mm", "eager"):
            assert cases[f"{implementation}/no_rows_to_some_experts"]["shape"] == [3, 32]
            assert cases[f"{implementation}/no_tokens_on_rank_1"]["shape"] == [0 if rank == 1 else 3, 32]
        for case in cases.values():
            assert case["output"] <= 1e-6 and case["grad"] <= 1e-6, cases


def test_a_dense_model_or_an_indivisible_expert_count_is_one_line(ranks):
    refusals = ranks[0]["refusals"]
    assert refusals["dense"] == ("parallel.ep=2 needs a mixture-of-experts model; LlamaForCausalLM has no sparse "
                                 "block: set parallel.ep=1 (docs/moe.md)")
    assert refusals["indivisible"].startswith("parallel.ep=2 must divide the 3 experts of model.layers.0.mlp")
