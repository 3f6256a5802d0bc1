"""FSDP2 models, gradient clipping, the optimizer step and the non-finite guard against a single-process reference.

Three launches of workers/fsdp_checks.py (each runs many checks and reports JSON per rank): a plain process (a world
of one, no torchrun), 2 ranks (FSDP) and 4 ranks (HSDP 2x2). The reference is the plain transformers model on the
whole global batch with loss = sum / global token count; ranks hold an uneven share (3 and 2 sequences; 2, 1, 1, 1)
in an agreed number of micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.launch import LaunchResult, launch, run_single

FP32_VARIANTS = ["tied", "untied", "untied_logits", "tied_ac", "untied_no_reshard", "tied_ac_no_reshard",
                 "tied_offload"]
BF16_VARIANTS = ["tied_bf16", "untied_bf16"]
HSDP_VARIANTS = ["tied", "untied", "tied_ac_no_reshard", "tied_bf16"]
SINGLE_VARIANTS = ["tied", "untied"]
VARIANTS = {"one_process": SINGLE_VARIANTS, "two_ranks": FP32_VARIANTS + BF16_VARIANTS, "hsdp": HSDP_VARIANTS}
FP32_TOL, BF16_TOL = 1e-5, 2e-2  # relative to the largest entry of the fp32 reference


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> LaunchResult:
    out = tmp_path_factory.mktemp("one_process")
    return run_single("fsdp_checks.py", out_dir=out, args=("--variants", ",".join(SINGLE_VARIANTS))).checked(1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> LaunchResult:
    out = tmp_path_factory.mktemp("two_ranks")
    variants = ",".join(FP32_VARIANTS + BF16_VARIANTS)
    return launch("fsdp_checks.py", nproc=2, out_dir=out, args=("--variants", variants)).checked(2)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> LaunchResult:
    out = tmp_path_factory.mktemp("hsdp")
    args = ("--dp-replicate", "2", "--variants", ",".join(HSDP_VARIANTS), "--extras", "value,guard")
    return launch("fsdp_checks.py", nproc=4, out_dir=out, args=args).checked(4)


@pytest.mark.parametrize("layout", ["one_process", "two_ranks",
                                    pytest.param("hsdp", marks=pytest.mark.slow)])  # HSDP: test_hsdp_2x2_matches_reference
def test_mesh_and_dp_size(request, layout):
    result = request.getfixturevalue(layout)
    expected = {"one_process": (1, ["dp_shard"]), "two_ranks": (2, ["dp_shard"]),
                "hsdp": (4, ["dp_replicate", "dp_shard"])}[layout]
    for rank_result in result.results.values():
        assert (rank_result["dp_size"], rank_result["mesh"]) == expected


def _relative(entry: dict) -> float:
    assert entry["keys_match"]
    return entry["err"] / entry["scale"]


@pytest.mark.parametrize("layout", ["one_process", "two_ranks", "hsdp"])
def test_gradients_clip_and_step_match_the_reference(request, layout):
    result = request.getfixturevalue(layout)
    for rank, rank_result in result.results.items():
        for name in VARIANTS[layout]:
            _assert_matches_reference(rank_result[name], name=name, where=f"{layout} rank {rank} {name}")


def _assert_matches_reference(got: dict, *, name: str, where: str) -> None:
    tol = BF16_TOL if name in BF16_VARIANTS else FP32_TOL
    assert _relative(got["grads"]) <= tol, (where, got["grads"])
    assert abs(got["norm"] - got["ref_norm"]) <= tol * got["ref_norm"], (where, got["norm"], got["ref_norm"])
    assert _relative(got["clipped"]) <= tol, (where, got["clipped"])
    assert _relative(got["stepped_weights"]) <= tol, (where, got["stepped_weights"])


def test_initial_weights_are_the_seeded_reference_at_any_world_size(request):
    digests = set()
    for layout, variants in VARIANTS.items():
        for rank_result in request.getfixturevalue(layout).results.values():
            for name in variants:
                got = rank_result[name]
                assert got["initial_weights"]["keys_match"] and got["initial_weights"]["err"] == 0.0, (layout, name)
                digests.add((name.startswith("tied"), got["initial_weights_digest"]))
    # One digest for all tied variants and one for all untied ones, whatever the world size.
    assert len(digests) == 2, digests


def test_every_rank_runs_the_same_number_of_forwards(two_ranks, hsdp):
    # Ranks hold 3 and 2 sequences (HSDP: 2, 1, 1, 1); the agreed count is 2 micro-batches everywhere.
    for result in (two_ranks, hsdp):
        assert {r["tied"]["forwards"] for r in result.results.values()} == {2}


def test_tied_embeddings_stay_tied(two_ranks):
    for rank_result in two_ranks.results.values():
        for name in FP32_VARIANTS + BF16_VARIANTS:
            assert rank_result[name]["tied_after_shard"] == name.startswith("tied"), name


def test_cpu_offload_setting_reaches_fully_shard(two_ranks):
    for rank_result in two_ranks.results.values():
        assert rank_result["tied_offload"]["offload_policies"] == ["CPUOffloadPolicy"]
        assert rank_result["tied"]["offload_policies"] == ["OffloadPolicy"]


@pytest.mark.parametrize("layout", ["two_ranks", "hsdp"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(request, layout):
    result = request.getfixturevalue(layout)
    skips = [r["tied"]["nonfinite_skip"] for r in result.results.values()]
    # The NaN sits in the last rank's shard; under HSDP the other replica group's norm stays finite, and the
    # world-wide decision must skip there too.
    assert not skips[-1]["norm_is_finite"]
    for skip in skips:
        assert skip["skipped"] and skip["warned"] and skip["weights_unchanged"] and skip["num_skipped"] == 1, skip


@pytest.mark.parametrize("layout", ["one_process", "two_ranks", "hsdp"])
def test_guard_stops_after_too_many_in_a_row(request, layout):
    result = request.getfixturevalue(layout)
    for rank_result in result.results.values():
        guard = rank_result["guard_stop"]
        # bad (skip), good (resets), bad (skip), bad (2 in a row = the limit: stop); 3 skipped in all.
        assert guard["decisions"] == [True, False, True]
        assert guard["raised"] is not None and "2 in a row" in guard["raised"], guard
        assert guard["num_skipped"] == 3


@pytest.mark.parametrize("layout", ["one_process", "two_ranks", "hsdp"])
def test_value_model_from_policy_weights(request, layout):
    result = request.getfixturevalue(layout)
    for rank_result in result.results.values():
        value = rank_result["value"]
        assert value["initial_weights"]["err"] == 0.0 and value["initial_weights"]["keys_match"]
        assert value["num_dropout_nonzero"] == 0
        assert _relative(value["grads"]) <= FP32_TOL, value["grads"]


def test_reference_model_is_frozen(one_process, two_ranks):
    for result in (one_process, two_ranks):
        for rank_result in result.results.values():
            ref = rank_result["reference"]
            assert not ref["requires_grad"] and not ref["training"]
            assert ref["initial_weights"]["err"] == 0.0 and ref["initial_weights"]["keys_match"]
            # bf16 params: stored in bf16 (half of fp32's bytes), the same logits as the policy's fp32 master cast
            assert ref["bf16_stored_dtypes"] == ["torch.bfloat16"] and ref["bf16_same_logits_as_policy"]


def test_memory_description(two_ranks):
    # Tiny Llama: embedding 128*64 = 8192; per layer q,o 2*64*64 + k,v 2*64*32 + mlp 3*64*128 + 2 norms 2*64
    # = 8192 + 4096 + 24576 + 128 = 36992, two layers 73984; final norm 64; tied head: 82240 = 0.08 M.
    memory = two_ranks.results[0]["tied"]["memory"]
    assert "0.08 M parameters" in memory and "2 shard(s)" in memory, memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_gpus_with_cpu_offload(tmp_path):
    """nccl + gloo on CUDA, CPU offload with pinned memory, bf16; the reference stays on the CPU."""
    nproc = min(torch.cuda.device_count(), 2)
    variants = ["tied", "tied_offload", "untied_bf16"]
    args = ("--device", "cuda", "--variants", ",".join(variants), "--extras", "value,guard")
    result = launch("fsdp_checks.py", nproc=nproc, out_dir=tmp_path, args=args).checked(nproc)
    for rank, rank_result in result.results.items():
        for name in variants:
            _assert_matches_reference(rank_result[name], name=name, where=f"gpu rank {rank} {name}")
        assert rank_result["tied_offload"]["offload_policies"] == ["CPUOffloadPolicy"]
        assert rank_result["tied"]["nonfinite_skip"]["skipped"]
        assert _relative(rank_result["value"]["grads"]) <= FP32_TOL
