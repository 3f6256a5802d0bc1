"""check-metrics on an MoE policy on 2 gloo ranks (docs/moe.md): the load-balancing loss, its gradient and the expert
load agree in every layout, the real ranks' included; a per-micro-batch aux loss and one that counts padding fail."""

from __future__ import annotations

from tests.dist.launch import launch
from tests.helpers.tiny_moe import write_tiny_moe


def test_two_ranks_pass_and_catch_both_planted_aux_loss_bugs(tmp_path):
    folder = write_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    result = launch("moe_check_checks.py", nproc=2, out_dir=tmp_path / "out", args=("--model", str(folder)),
                    timeout_s=600).checked(2, error_free=True)
    for rank in (0, 1):
        record = result.results[rank]
        assert record["clean"]["ok"], record["clean"]["failures"]
        assert {"actor/moe/aux_loss [ranks=2]", "actor/moe/layer_0/load_cv [ranks=2]",
                "actor/grad_max_diff [ranks=2]", "actor/moe/aux_loss [padded]"} <= set(record["clean"]["compared"])
        assert not record["per_micro_batch"]["ok"]
        assert any("actor/moe/aux_loss [micro-batches=2]" in line for line in record["per_micro_batch"]["failures"])
        assert not record["counts_padding"]["ok"]
        assert any("actor/moe/aux_loss [padded]" in line for line in record["counts_padding"]["failures"])
