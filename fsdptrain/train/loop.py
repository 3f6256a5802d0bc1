"""The training loop: rollouts -> experience -> epochs x mini-batches of the FSDP2 update -> metrics -> log.

Set-up is split into ``build_*`` helpers; :meth:`Trainer.run_step` reads top to bottom as the data path of
docs/architecture.md. Every rank runs this code; rank 0 alone prints and writes the run directory.

Prompt groups are owned by rank ``index % world_size`` and belong to mini-batch ``index // (P / M)``, both fixed by
the group's global index within the step, so the mini-batches hold the same data at any world size.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import validate_world
from fsdptrain.data.rollout import Rollout
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.distributed.files import write_atomic
from fsdptrain.model.drafter import DraftVocab, draft_vocab_from_counts
from fsdptrain.rl.metrics import Max, Mean, Metrics, Sum, close_minibatch, finalize, merge_all
from fsdptrain.rl.packed_loss import SeqTargets
from fsdptrain.train.drafter_setup import build_drafter, draft_vocab_size, local_token_counts, vocab_from_file
from fsdptrain.train.experience import experience_settings, make_targets
from fsdptrain.train.group_filter import filter_groups
from fsdptrain.train.optim import NonFiniteGuard
from fsdptrain.train.perf import StepTimer, peak_tflops, phase, step_flops, throughput
from fsdptrain.train.progress import (
    METRIC_KINDS_FILE,
    GradNormWatch,
    log,
    metric_kinds,
    print_samples,
    print_start_report,
    print_summary,
    progress_columns,
    quiet_known_warnings,
    read_metric_kinds,
    stats_line,
    write_metric_kinds,
    write_metrics_line,
    write_samples,
)
from fsdptrain.train.prompt_source import PromptSource, resolve_steps
from fsdptrain.train.run_dir import export, keep_metrics_before, resume, save
from fsdptrain.train.setup import (
    build_models,
    build_tokenizer,
    loss_scale_factor,
    policy_settings,
    resolve_device_type,
    value_settings,
)
from fsdptrain.train.signals import StopRequest
from fsdptrain.train.sources import OfflineSource
from fsdptrain.train.step import packed_policy_loss, packed_value_loss
from fsdptrain.train.step import DrafterUpdate, MiniBatch, update_on_minibatch
from fsdptrain.train.trackers import Trackers


def actor_and_drafter_names(metrics: Metrics) -> Metrics:
    """The policy step's metrics under `actor/`, the co-trained drafter's under their own `drafter/` names."""
    return Metrics((name if name.startswith("drafter/") else "actor/" + name, metric)
                   for name, metric in metrics.items())


class Trainer:
    """Owns the models, the experience source and the run directory for one ``fsdptrain train`` run."""

    def __init__(self, cfg: DictConfig, run_dir: Path, info: world.DistInfo, mesh):
        self.cfg, self.run_dir, self.info, self.mesh = cfg, run_dir, info, mesh
        self.device = info.device
        self.dp_size = world.dp_size(mesh)
        self.tokenizer = build_tokenizer(cfg)
        self.source = OfflineSource(cfg, self.tokenizer) if cfg.data.source == "jsonl" else PromptSource(
            cfg, self.tokenizer)
        self.num_steps = resolve_steps(cfg, getattr(self.source, "train_rows", None) and len(self.source.train_rows))
        self.models = build_models(cfg, self.tokenizer, mesh, self.device, num_steps=self.num_steps)
        self.policy_settings = policy_settings(cfg)
        self.experience_settings = experience_settings(cfg)
        self.value_settings = value_settings(cfg)
        self.loss_scale_factor = loss_scale_factor(cfg)
        self.policy_guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        self.critic_guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        self.policy_watch = GradNormWatch(cfg.trainer.grad_norm_warn_factor, cfg.trainer.grad_clip, "policy")
        self.critic_watch = GradNormWatch(cfg.trainer.grad_norm_warn_factor, cfg.trainer.critic_grad_clip, "critic")
        self.skip_old_passes = skips_old_passes(cfg)
        self.peak_tflops = peak_tflops(cfg.perf.peak_tflops, self.device)
        self.kinds: dict[str, str] = {}
        """The kind of every typed metric logged so far (``Kind`` values); the other logged numbers are facts."""
        self.drafter: Optional[DrafterUpdate] = None
        self.drafter_scheduler = None
        self.draft_counts: Optional[torch.Tensor] = None
        """Token counts (summed over ranks) of the steps so far, while the draft vocabulary is being counted."""
        if cfg.drafter.enabled:
            vocab_size = self.models.policy.config.vocab_size
            draft_vocab_size(cfg, vocab_size)  # a size above the vocabulary fails before the first step
            if cfg.drafter.path is not None:  # the saved drafter, its vocabulary with it
                self.start_drafter(None)
            elif cfg.drafter.vocab_path is not None:
                self.start_drafter(vocab_from_file(cfg, vocab_size))

    # -- the co-trained drafter -------------------------------------------------------------------------------------

    def start_drafter(self, vocab: Optional[DraftVocab]) -> None:
        """Build the sharded drafter, its optimizer and scheduler over `vocab`, or from `drafter.path` when None
        (collective)."""
        self.drafter, self.drafter_scheduler = build_drafter(self.cfg, self.models.policy, vocab, mesh=self.mesh,
                                                             device=self.device, backend=self.models.backend,
                                                             num_steps=self.num_steps)

    def count_draft_vocab(self, step: int, rollouts: list[Rollout]) -> None:
        """Add this step's token counts (summed over ranks); after `drafter.vocab_from_steps` steps, build the
        drafter over the most frequent tokens (collective)."""
        vocab_size = self.models.policy.config.vocab_size
        counts = world.all_reduce_sum(local_token_counts(rollouts, vocab_size, on=self.cfg.drafter.on))
        self.draft_counts = counts if self.draft_counts is None else self.draft_counts + counts
        if step + 1 >= self.cfg.drafter.vocab_from_steps:
            size = draft_vocab_size(self.cfg, vocab_size)
            self.start_drafter(draft_vocab_from_counts(self.draft_counts, draft_vocab_size=size))
            self.draft_counts = None

    # -- experience --------------------------------------------------------------------------------------------------

    def make_experience(self, rollouts: list[Rollout]) -> tuple[list[SeqTargets], dict]:
        """Old/ref log-probs, values, rewards, advantages and weights for this rank's rollouts (collective passes);
        facts: ``on_policy`` and this rank's experience ``metrics``."""
        targets, on_policy, metrics = make_targets(self.models, rollouts, self.experience_settings,
                                                   device=self.device, skip_old_passes=self.skip_old_passes)
        return targets, {"on_policy": on_policy, "metrics": metrics}

    def step_rollouts(self, step: int) -> tuple[list[Rollout], Metrics]:
        """This rank's rollouts of the step, filtered to groups with a signal under ``algorithm.filter_groups``."""
        rank, world_size = self.info.rank, self.info.world_size
        rollouts = self.source.rollouts(self.models, step, rank=rank, world_size=world_size, device=self.device)
        if not self.cfg.algorithm.filter_groups:
            return rollouts, Metrics({})

        def more(round_index: int) -> list[Rollout]:
            return self.source.rollouts(self.models, step, rank=rank, world_size=world_size, device=self.device,
                                        round_index=round_index)

        return filter_groups(rollouts, more, target_groups=self.cfg.rollout.prompts_per_step,
                             max_rounds=self.cfg.algorithm.filter_groups_max_rounds, rank=rank, world_size=world_size)

    # -- one step ----------------------------------------------------------------------------------------------------

    def minibatches(self, rollouts: list[Rollout], targets: list[SeqTargets]) -> list[MiniBatch]:
        """This rank's share of each mini-batch, by the groups' global indices."""
        num_batches = self.cfg.trainer.mini_batches_per_step
        per_mb = self.cfg.rollout.prompts_per_step // num_batches
        if self.cfg.algorithm.filter_groups:  # fewer groups may be kept: spread them over the mini-batches
            num_groups = world.agree_max_int(max((r.group + 1 for r in rollouts), default=0))
            per_mb = max(1, -(-num_groups // num_batches))
            num_batches = min(num_batches, -(-num_groups // per_mb))
        batches = [MiniBatch([], [], []) for _ in range(num_batches)]
        for rollout, target in zip(rollouts, targets):
            batch = batches[rollout.group // per_mb]
            batch.prompts.append(rollout.prompt_ids)
            batch.responses.append(rollout.response_ids)
            batch.targets.append(target)
        return batches

    def rollout_metrics(self, rollouts: list[Rollout], reward_metrics: Metrics | None = None) -> Metrics:
        """The step's rollout metrics over all ranks; ``reward_metrics`` (the reward functions', which hold
        ``reward/mean``) replace the plain reward mean when the source scored the rollouts itself."""
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
        truncated = torch.tensor([float(r.truncated) for r in rollouts], dtype=torch.float64)
        valid = torch.ones_like(rewards, dtype=torch.bool)
        rewards_part = dict(reward_metrics) if reward_metrics is not None else {"reward/mean": Mean.of(rewards, valid)}
        return reduce_metrics(Metrics({
            **rewards_part,
            "reward/max": Max.of(rewards, valid),
            "response_length/mean": Mean.of(lengths, valid),
            "response_length/max": Max.of(lengths, valid),
            "response_length/truncated_frac": Mean.of(truncated, valid),
            "batch/num_seqs": Sum(len(rollouts)),
            "batch/num_response_tokens": Sum(float(lengths.sum())),
            "batch/num_prompt_tokens": Sum(float(sum(len(r.prompt_ids) for r in rollouts))),
        }))

    def update(self, batches: list[MiniBatch], on_policy: bool) -> tuple[Metrics, dict[str, float]]:
        """Epochs x mini-batches of the policy (and critic) update; the merged metrics and per-step facts."""
        cfg, models = self.cfg, self.models
        common = dict(dp_size=self.dp_size, loss_scale_factor=self.loss_scale_factor,
                      token_budget=cfg.trainer.token_budget, device=self.device)
        collected = []
        facts = {"actor/grad_norm": [], "critic/grad_norm": [], "loss/global_num_tokens": [],
                 "loss/global_num_seqs": [], "drafter/grad_norm": [], "drafter/global_num_tokens": []}
        guard_value = None
        for epoch in range(cfg.algorithm.ppo_epochs):
            for index, batch in enumerate(batches):
                metrics, outcome = update_on_minibatch(
                    models.policy, models.policy_optimizer, batch, loss_fn=packed_policy_loss,
                    settings=self.policy_settings, grad_clip=cfg.trainer.grad_clip, guard=self.policy_guard,
                    drafter=self.drafter, **common)
                if epoch == 0 and index == 0 and on_policy:
                    values = finalize(metrics)
                    deviations = [abs(values[k] - 1.0) for k in ("probs_ratio_min", "probs_ratio_max") if k in values]
                    guard_value = max(deviations) if deviations else None
                collected.append(close_minibatch(actor_and_drafter_names(metrics)))
                facts["actor/grad_norm"].append(outcome.grad_norm)
                if outcome.drafter is not None:
                    facts["drafter/grad_norm"].append(outcome.drafter.grad_norm)
                    facts["drafter/global_num_tokens"].append(outcome.drafter.norms.global_num_tokens)
                facts["loss/global_num_tokens"].append(outcome.norms.global_num_tokens)
                facts["loss/global_num_seqs"].append(outcome.norms.global_num_seqs)
                self.policy_watch.observe(outcome.grad_norm)
                if models.critic is not None:
                    metrics, outcome = update_on_minibatch(
                        models.critic, models.critic_optimizer, batch, loss_fn=packed_value_loss,
                        settings=self.value_settings, grad_clip=cfg.trainer.critic_grad_clip,
                        guard=self.critic_guard, **common)
                    collected.append(close_minibatch(metrics.prefixed("critic/")))
                    facts["critic/grad_norm"].append(outcome.grad_norm)
                    self.critic_watch.observe(outcome.grad_norm)
        out = {key: sum(v) / len(v) for key, v in facts.items() if v}
        if guard_value is not None:
            out["actor/on_policy_max_ratio_dev"] = guard_value
        return merge_all(collected), out

    def step_flops(self, rollouts: list[Rollout]) -> float:
        """This rank's model FLOPs of the step (docs/performance.md), by the passes the step ran (the drafter's
        refresh passes each add a policy forward over the batch; the drafter's own FLOPs are not counted)."""
        cfg, models = self.cfg, self.models
        epochs = cfg.algorithm.ppo_epochs
        refresh_forwards = epochs * self.drafter.refresh_passes if self.drafter is not None else 0
        critic_pass = models.critic is not None and (cfg.algorithm.adv_estimator == "gae"
                                                     or not self.skip_old_passes)
        return step_flops(models.policy.config, [len(r.prompt_ids) for r in rollouts],
                          [len(r.response_ids) for r in rollouts], generated=isinstance(self.source, PromptSource),
                          policy_forwards=(int(not self.skip_old_passes) + int(models.reference is not None)
                                           + refresh_forwards),
                          critic_forwards=int(critic_pass), policy_updates=epochs,
                          critic_updates=epochs if models.critic is not None else 0)

    def run_step(self, step: int) -> dict[str, float]:
        """One training step on every rank; returns the finalised metrics (the same on every rank)."""
        with StepTimer() as timer:
            rollouts, filter_metrics = self.step_rollouts(step)
            if world.agree_max_int(len(rollouts)) == 0:
                raise RuntimeError(f"step {step}: no prompt group with a reward signal after "
                                   f"{self.cfg.algorithm.filter_groups_max_rounds} round(s) of dynamic sampling: "
                                   "raise algorithm.filter_groups_max_rounds or rollout.prompts_per_step")
            if self.cfg.drafter.enabled and self.drafter is None:
                self.count_draft_vocab(step, rollouts)
            with phase("experience"):
                targets, facts = self.make_experience(rollouts)
            batches = self.minibatches(rollouts, targets)
            with phase("update"):
                update_metrics, update_facts = self.update(batches, facts["on_policy"])
            for scheduler in (self.models.policy_scheduler, self.models.critic_scheduler, self.drafter_scheduler):
                if scheduler is not None:
                    scheduler.step()
            experience = merge_all([filter_metrics, facts["metrics"]])
            experience = reduce_metrics(experience) if experience else experience  # names fixed by the config
            metrics = merge_all([self.rollout_metrics(rollouts, self.source.step_metrics), experience,
                                 update_metrics])
        result = {"step": step, **finalize(metrics), **update_facts}
        perf = merge_all([timer.metrics(), throughput(
            timer.timings(), result=result, update_epochs=self.cfg.algorithm.ppo_epochs,
            step_flops_local=self.step_flops(rollouts), peak=self.peak_tflops, device=self.device,
            world_size=self.info.world_size)])
        result.update(finalize(perf))
        self.kinds.update((name, metric.kind.value) for group in (metrics, perf) for name, metric in group.items())
        result["actor/lr"] = self.models.policy_optimizer.param_groups[0]["lr"]
        result["loss/loss_scale_factor"] = self.loss_scale_factor
        result["train/nonfinite_skipped"] = self.policy_guard.num_skipped + self.critic_guard.num_skipped
        if isinstance(self.source, PromptSource):
            result["data/epoch"] = self.source.epoch_progress()
            result["data/num_long_prompts_skipped"] = self.source.dropped["train"]
        if self.drafter is not None:
            result["drafter/lr"] = self.drafter.optimizer.param_groups[0]["lr"]
            result["drafter/nonfinite_skipped"] = self.drafter.guard.num_skipped
        return result


def skips_old_passes(cfg: DictConfig) -> bool:
    """Whether the old log-prob pass (and the critic's old-value pass when GAE does not need the values) can be
    skipped exactly: one epoch of one mini-batch, so the first update forward sees the weights that generated the
    experience; no behaviour log-probs from data; and no KL-in-reward (it reads the old log-probs before the update)."""
    return (cfg.algorithm.recompute_old_logprobs == "auto" and cfg.algorithm.ppo_epochs == 1
            and cfg.trainer.mini_batches_per_step == 1 and cfg.data.source != "jsonl"
            and cfg.algorithm.kl_in_reward_coef == 0)


# ---- the run --------------------------------------------------------------------------------------------------------


def train(cfg: DictConfig, run_dir: str) -> int:
    """The ``fsdptrain train`` job on this rank; returns the exit code."""
    quiet_known_warnings()
    stop = StopRequest()
    stop.install()
    info = world.init_distributed(device_type=resolve_device_type(cfg))
    replicate, shard = validate_world(cfg, info.world_size)
    mesh = world.build_mesh(dp_replicate=replicate, dp_shard=shard, device_type=info.device.type)
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    run_path = Path(run_dir)
    trainer = Trainer(cfg, run_path, info, mesh)
    try:  # the reward worker processes and the trackers end on every way out (errors, Ctrl-C, SIGTERM)
        code = _run(trainer, stop)
    finally:
        trainer.source.close()
    world.destroy_distributed()
    return code


def _run(trainer: Trainer, stop: StopRequest) -> int:
    cfg, info, run_path, num_steps = trainer.cfg, trainer.info, trainer.run_dir, trainer.num_steps
    start = resume(trainer, run_path)
    metrics_path, samples_path = run_path / "metrics.jsonl", run_path / "samples.jsonl"
    kinds_path = run_path / METRIC_KINDS_FILE
    logged_kinds = read_metric_kinds(kinds_path) if start > 0 else {}
    if info.is_main:
        run_path.mkdir(parents=True, exist_ok=True)
        write_atomic(run_path / "config.yaml", OmegaConf.to_yaml(cfg))
        keep_metrics_before(metrics_path, start)
        keep_metrics_before(samples_path, start)
    print_start_report(trainer)
    eval_rewards: dict[int, float] = {}
    evaluate = cfg.trainer.eval_every > 0 and bool(getattr(trainer.source, "eval_rows", None))
    eval_args = dict(rank=info.rank, world_size=info.world_size, device=trainer.device)
    if evaluate and start == 0:
        eval_rewards[0] = trainer.source.eval_reward(trainer.models, **eval_args)
    history = []
    trackers = Trackers(cfg, run_path, is_main=info.is_main)
    show = info.is_main and cfg.logging.progress
    from rich.progress import Progress

    try:
        with Progress(*progress_columns(), disable=not show, transient=False) as progress:
            task = progress.add_task("train", total=num_steps, completed=start, stats="")
            for step in range(start, num_steps):
                result = trainer.run_step(step)
                done = step + 1
                if evaluate and (done % cfg.trainer.eval_every == 0 or done == num_steps):
                    eval_rewards[done] = trainer.source.eval_reward(trainer.models, **eval_args)
                    result["eval/reward"] = eval_rewards[done]
                if isinstance(trainer.source, OfflineSource):
                    result["data/skipped_rows"] = trainer.source.num_skipped
                history.append(result)
                every = cfg.logging.samples_every
                if info.is_main:
                    write_metrics_line(metrics_path, result)
                    now = metric_kinds(result, trainer.kinds)
                    if not now.items() <= logged_kinds.items():
                        logged_kinds.update(now)
                        write_metric_kinds(kinds_path, logged_kinds)
                    trackers.log(result)
                    if trainer.source.samples and every > 0 and step % every == 0:
                        write_samples(samples_path, step, trainer.source.samples)
                    if step == start and trainer.source.samples:
                        print_samples(progress.console if show else None, step, trainer.source.samples)
                progress.update(task, advance=1, stats=stats_line(result))
                stopping = world.any_flag(stop.requested)
                every = cfg.checkpoint.every
                if stopping or (every > 0 and done % every == 0 and done < num_steps):
                    path = save(trainer, run_path, done)
                if stopping:
                    where = (f"trainer.run_dir={run_path}" if cfg.trainer.run_dir is not None else
                             f"trainer.run_name={run_path.name}")
                    log(f"interrupted: saved checkpoint {path.name} in {path.parent}; resume with {where} "
                        "trainer.resume=auto")
                    return 0
    finally:
        trackers.close()
    if cfg.checkpoint.every > 0 and start < num_steps:  # else the resumed checkpoint is this one
        save(trainer, run_path, num_steps)
    export(trainer, run_path)
    if info.is_main and history:
        print_summary(history, eval_rewards)
    log(f"run directory: {run_path} (metrics.jsonl, export/)")
    return 0
