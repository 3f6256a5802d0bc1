"""A float64 FSDP2 model (check-metrics' float64 mode, fsdptrain/check/precision.py) is the same model on every rank:
its rotary frequencies, broadcast from rank 0's float32 full model, arrive as rank 0's values, and the logits on the
same input agree exactly (2 gloo ranks)."""

from __future__ import annotations

import pytest

from tests.dist.launch import launch


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    result = launch("float64_model_checks.py", nproc=2, out_dir=tmp_path_factory.mktemp("float64"), timeout_s=300)
    return result.checked(2).results


def test_every_rank_holds_rank_0s_buffers_and_gives_its_logits(records):
    for rank in (0, 1):
        assert records[rank]["buffer_dtypes"] == ["torch.float64"] and records[rank]["logits_dtype"] == "torch.float64"
        differences = {k: v for k, v in records[rank].items() if k.endswith("largest_difference_to_rank0")}
        assert len(differences) >= 2 and all(v == 0.0 for v in differences.values()), differences
