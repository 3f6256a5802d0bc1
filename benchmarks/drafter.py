"""Benchmark of the co-trained drafter (not a test): why co-training matters, and what it costs.

    PYTHONPATH=. python benchmarks/drafter.py                     # the bundled default, 100 steps
    PYTHONPATH=. python benchmarks/drafter.py trainer.steps=30 drafter.lr=3e-3   # any config overrides

Three runs of the same config, one after another in this process (a world of one rank):
- co-trained: `drafter.enabled=true`, the policy and its drafter trained together, as `fsdptrain train` does;
- frozen: the same drafter trained for the same number of steps on the INITIAL policy's rollouts and teacher (the
  policy's learning rate is zeroed, so its AdamW steps leave it unchanged), then frozen: a drafter trained once
  before RL;
- off: the drafter off (the step-time baseline; its policy run is the co-trained run's, bit for bit).
Both drafters are then scored against the co-trained run's FINAL policy, on its rollouts of --eval-steps fresh
steps: the draft loss's own metrics (`drafter/accept_prob`, `drafter/expected_accept_len@3`,
`drafter/top1_agreement`), side by side.

Overhead (goal: at most 15% of the step). First, and the measure a shared machine disturbs least: one step's
mini-batches updated with and without the drafter, alternately, --repeats times each (best of), against that step's
rollout and experience time (`--overhead-only` stops there). Then the whole runs' step times with the drafter over
those without, minus one, by the median and the minimum over the steps after the first (which builds the drafter).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from fsdptrain.config.compose import compose_config
from fsdptrain.data.packing import pack_sequences, plan_packs
from fsdptrain.distributed import world
from fsdptrain.model.drafter import capture_policy_features, run_drafter, teacher_head_rows
from fsdptrain.rl.draft_loss import draft_loss
from fsdptrain.rl.draft_loss import packed_draft_mask
from fsdptrain.metrics.typed import finalize, merge_all
from fsdptrain.train.cotrain import global_normalizers_with_draft, local_draft_counts
from fsdptrain.train.rl import Trainer
from fsdptrain.run.console import quiet_known_warnings

METRICS = ("drafter/accept_prob", "drafter/expected_accept_len@3", "drafter/top1_agreement", "drafter/loss")


def run(overrides: list[str], *, freeze_policy: bool = False) -> tuple[Trainer, list[dict]]:
    cfg = compose_config(overrides)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=1, device_type="cpu")
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()), info, mesh)
    if freeze_policy:  # AdamW with lr 0 and no weight decay leaves every weight as it is
        part = trainer.models.policy_part
        part.scheduler.base_lrs = [0.0 for _ in part.scheduler.base_lrs]
        for group in part.optimizer.param_groups:
            group["lr"] = 0.0
    rows = []
    for step in range(trainer.num_steps):
        rows.append(trainer.run_step(step))
        if step % 10 == 0 or step == trainer.num_steps - 1:
            shown = {k: round(rows[-1][k], 4) for k in ("reward/mean", "drafter/accept_prob") if k in rows[-1]}
            print(f"  step {step}: {shown}", flush=True)
    return trainer, rows


@torch.no_grad()
def score(policy_trainer: Trainer, drafter, rollouts) -> dict[str, float]:
    """The drafter's metrics against `policy_trainer`'s policy on `rollouts` (one mini-batch, token budget packs)."""
    cfg, policy = policy_trainer.cfg, policy_trainer.models.policy
    prompts, responses = [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts]
    plan = plan_packs([len(p) + len(r) for p, r in zip(prompts, responses)], cfg.trainer.token_budget)
    counts = (sum(len(r) for r in responses), sum(1 for r in responses if r))
    _, norms = global_normalizers_with_draft(counts, local_draft_counts(prompts, responses, plan, on=cfg.drafter.on),
                                             dp_size=1, loss_scale_factor=policy_trainer.loss_scale_factor)
    collected = []
    for pack in plan.packs:
        packed = pack_sequences(prompts, responses, pack)
        features = capture_policy_features(policy, packed, feature_layers=drafter.feature_layers)
        teacher_DH, bias_D = teacher_head_rows(policy, drafter)
        with drafter.attention(policy_trainer.models.backend):
            hidden_TH = run_drafter(drafter, features, packed)
        mask_T = packed_draft_mask(packed, on=cfg.drafter.on)
        _, metrics = draft_loss(hidden_TH, drafter.lm_head.weight, features.final_hidden_TH, teacher_DH, mask_T,
                                norms=norms, agg_mode=cfg.loss.agg_mode, cu_seqlens=packed.cu_seqlens,
                                temperature=cfg.rollout.temperature, chunk_size=cfg.loss.logprob_chunk_size,
                                teacher_bias_D=bias_D)
        collected.append(metrics)
    return finalize(merge_all(collected))


def interleaved_overhead(overrides: list[str], repeats: int) -> dict[str, float]:
    """One step's rollouts and experience, then its update timed with the drafter and without, alternately,
    `repeats` times each (best of): on a shared machine the least disturbed measure of the drafter's cost."""
    import time

    cfg = compose_config([*overrides, "drafter.enabled=true"])
    info = world.init_distributed(device_type="cpu")
    mesh = world.build_mesh(dp_replicate=1, dp_shard=1, device_type="cpu")
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()), info, mesh)
    start = time.perf_counter()
    rollouts, _ = trainer.step_rollouts(0)
    trainer.extensions[0].on_rollouts(0, rollouts)
    targets, facts = trainer.make_experience(rollouts)
    batches = trainer.minibatches(rollouts, targets)
    before_update = time.perf_counter() - start
    drafter, best = trainer.extensions[0].update, {"on": float("inf"), "off": float("inf")}
    for _ in range(repeats):
        for mode in ("off", "on"):
            trainer.extensions[0].update = drafter if mode == "on" else None
            start = time.perf_counter()
            trainer.update(batches, facts["on_policy"])
            best[mode] = min(best[mode], time.perf_counter() - start)
    return {"rollout_and_experience_s": before_update, "update_s_on": best["on"], "update_s_off": best["off"],
            "overhead_of_step": (best["on"] - best["off"]) / (before_update + best["off"]),
            "overhead_of_update": best["on"] / best["off"] - 1.0}


def step_times(rows: list[dict]) -> list[float]:
    return [r["perf/step_s"] for r in rows[1:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eval-steps", type=int, default=2, help="fresh steps of final-policy rollouts to score on")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--overhead-only", action="store_true", help="only the interleaved update timing")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved update timings per setting")
    args, overrides = parser.parse_known_args()
    quiet_known_warnings()
    base = ["logging.progress=false", "trainer.eval_every=0", *overrides]
    timing = interleaved_overhead(base, args.repeats)
    print(f"interleaved, best of {args.repeats}: update {timing['update_s_on']:.3f} s with the drafter, "
          f"{timing['update_s_off']:.3f} s without ({100 * timing['overhead_of_update']:.1f}% of the update); "
          f"rollouts + experience {timing['rollout_and_experience_s']:.3f} s; overhead of the step "
          f"{100 * timing['overhead_of_step']:.1f}% (goal <= 15%)", flush=True)
    if args.overhead_only:
        return
    print("co-trained drafter (drafter.enabled=true):", flush=True)
    cotrained, rows_on = run([*base, "drafter.enabled=true"])
    print("frozen drafter (trained on the initial policy's rollouts, then frozen):", flush=True)
    frozen, _ = run([*base, "drafter.enabled=true"], freeze_policy=True)
    print("drafter off (step-time baseline):", flush=True)
    _, rows_off = run(base)
    steps = cotrained.num_steps
    rollouts = [r for k in range(args.eval_steps)
                for r in cotrained.source.rollouts(cotrained.models, steps + k, rank=0, world_size=1,
                                                   device=cotrained.device)]
    results = {
        "steps": steps,
        "eval_sequences": len(rollouts),
        "co-trained": score(cotrained, cotrained.auxiliary_loss().module, rollouts),
        "frozen": score(cotrained, frozen.auxiliary_loss().module, rollouts),
        "accept_prob_first5": statistics.mean(r["drafter/accept_prob"] for r in rows_on[:5]),
        "accept_prob_last5": statistics.mean(r["drafter/accept_prob"] for r in rows_on[-5:]),
        "accept_len3_first5": statistics.mean(r["drafter/expected_accept_len@3"] for r in rows_on[:5]),
        "accept_len3_last5": statistics.mean(r["drafter/expected_accept_len@3"] for r in rows_on[-5:]),
        "step_times_on": step_times(rows_on),
        "step_times_off": step_times(rows_off),
        "interleaved": timing,
    }
    for stat, reduce in (("median", statistics.median), ("min", min)):
        on, off = reduce(results["step_times_on"]), reduce(results["step_times_off"])
        results[f"overhead_{stat}"] = on / off - 1.0
        results[f"step_time_s_{stat}"] = [on, off]
    print(f"\nscored on {results['eval_sequences']} rollouts of the final policy (after {steps} steps):")
    print(f"{'metric':34s} {'co-trained':>12s} {'frozen':>12s}")
    for key in METRICS:
        print(f"{key:34s} {results['co-trained'].get(key, float('nan')):12.4f} "
              f"{results['frozen'].get(key, float('nan')):12.4f}")
    print(f"co-trained drafter/accept_prob during training: first 5 steps {results['accept_prob_first5']:.4f}, "
          f"last 5 steps {results['accept_prob_last5']:.4f}; expected_accept_len@3 "
          f"{results['accept_len3_first5']:.4f} -> {results['accept_len3_last5']:.4f}")
    for stat in ("median", "min"):
        on, off = results[f"step_time_s_{stat}"]
        print(f"step time ({stat} over the steps after step 0): {on:.3f} s with the drafter, {off:.3f} s without: "
              f"overhead {100 * results[f'overhead_{stat}']:.1f}% (goal <= 15%)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    world.destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
