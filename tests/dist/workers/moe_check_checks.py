"""check-metrics' layouts on a tiny Qwen3-MoE policy on real ranks: clean, then with each planted load-balancing bug
(tests/helpers/planted_bugs.py); each rank records whether the report passed and its failure lines."""

from __future__ import annotations

from fsdptrain.check.batch import build_session
from fsdptrain.check.run import run_checks
from fsdptrain.config.compose import compose_config
from fsdptrain.distributed import world
from fsdptrain.train import pack_losses
from tests.dist.workers.report import dist_worker, option
from tests.helpers.planted_bugs import plant_moe_aux_loss_counts_padding, plant_moe_aux_loss_per_micro_batch

LAYOUTS_ONLY = dict(off_policy=False, experience=False, update=False)


@dist_worker(option("--model", required=True), traceback_in_record=True)
def main(args, info, record: dict) -> None:
    cfg = compose_config(["model=local", f"model.path={args.model}", "algorithm=grpo", "rollout.prompts_per_step=2",
                          "rollout.n=2", "rollout.max_new_tokens=6", "model.moe.aux_loss_coef=0.5"])
    mesh = world.build_mesh(dp_replicate=1, dp_shard=None, device_type="cpu")
    session = build_session(cfg, info, mesh)
    saved = {name: getattr(pack_losses, name) for name in ("aux_loss_share", "route_weights")}
    for name, plant in (("clean", None), ("per_micro_batch", plant_moe_aux_loss_per_micro_batch),
                        ("counts_padding", plant_moe_aux_loss_counts_padding)):
        if plant is not None:
            plant()
        report = run_checks(session, "token-mean", **LAYOUTS_ONLY)
        for attr, value in saved.items():
            setattr(pack_losses, attr, value)
        record[name] = {"ok": report.ok, "failures": report.failures,
                        "compared": sorted({f"{c.metric} [{c.layout}]" for c in report.comparisons if c.passed})}


if __name__ == "__main__":
    main()
