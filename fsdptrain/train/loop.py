"""The training loop: rollouts -> experience -> epochs x mini-batches of the FSDP2 update -> metrics -> log.

Set-up is split into ``build_*`` helpers; :meth:`Trainer.run_step` reads top to bottom as the data path of
docs/architecture.md. Every rank runs this code; rank 0 alone prints and writes the run directory.

Prompt groups are owned by rank ``index % world_size`` and belong to mini-batch ``index // (P / M)``, both fixed by
the group's global index within the step, so the mini-batches hold the same data at any world size.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import validate_world
from fsdptrain.data.rollout import Rollout
from fsdptrain.distributed import world
from fsdptrain.rl.metrics import Max, Mean, Metrics, Sum, close_minibatch, finalize, merge_all
from fsdptrain.train.experience import (
    critic_values,
    gae_targets,
    group_targets,
    policy_logprobs,
    reward_to_go,
    token_rewards,
)
from fsdptrain.train.optim import NonFiniteGuard
from fsdptrain.train.packed_loss import SeqTargets, packed_policy_loss, packed_value_loss
from fsdptrain.train.perf import StepTimer, peak_tflops, phase, step_flops, throughput
from fsdptrain.train.progress import (
    GradNormWatch,
    log,
    open_tensorboard,
    print_start_report,
    print_summary,
    progress_columns,
    quiet_known_warnings,
    stats_line,
    write_metrics_line,
    write_tensorboard,
)
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
from fsdptrain.train.sources import OfflineSource, TaskSource
from fsdptrain.train.step import MiniBatch, reduce_metrics, update_on_minibatch


class Trainer:
    """Owns the models, the experience source and the run directory for one ``fsdptrain train`` run."""

    def __init__(self, cfg: DictConfig, run_dir: Path, info: world.DistInfo, mesh):
        self.cfg, self.run_dir, self.info, self.mesh = cfg, run_dir, info, mesh
        self.device = info.device
        self.dp_size = world.dp_size(mesh)
        self.tokenizer = build_tokenizer(cfg)
        self.source = OfflineSource(cfg, self.tokenizer) if cfg.data.source == "jsonl" else TaskSource(
            cfg, self.tokenizer)
        self.models = build_models(cfg, self.tokenizer, mesh, self.device)
        self.policy_settings = policy_settings(cfg)
        self.value_settings = value_settings(cfg)
        self.loss_scale_factor = loss_scale_factor(cfg)
        self.policy_guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        self.critic_guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        self.policy_watch = GradNormWatch(cfg.trainer.grad_norm_warn_factor, cfg.trainer.grad_clip, "policy")
        self.critic_watch = GradNormWatch(cfg.trainer.grad_norm_warn_factor, cfg.trainer.critic_grad_clip, "critic")
        self.skip_old_passes = skips_old_passes(cfg)
        self.peak_tflops = peak_tflops(cfg.perf.peak_tflops, self.device)

    # -- experience --------------------------------------------------------------------------------------------------

    def make_experience(self, rollouts: list[Rollout]) -> tuple[list[SeqTargets], dict[str, float]]:
        """Old/ref log-probs, values, rewards and advantages for this rank's rollouts (collective passes)."""
        cfg, models = self.cfg, self.models
        budget, device = cfg.trainer.token_budget, self.device
        chunk, temperature = cfg.loss.logprob_chunk_size, cfg.rollout.temperature
        old_logprobs = None if self.skip_old_passes else policy_logprobs(
            models.policy, rollouts, temperature=temperature, chunk_size=chunk, token_budget=budget, device=device)
        behaviour = [r.behaviour_logprobs for r in rollouts]
        if any(b is not None for b in behaviour):
            old_logprobs = [torch.tensor(b, dtype=torch.float32) if b is not None else lp
                            for b, lp in zip(behaviour, old_logprobs)]
        ref_logprobs = None
        if models.reference is not None:
            ref_logprobs = policy_logprobs(models.reference, rollouts, temperature=temperature, chunk_size=chunk,
                                           token_budget=budget, device=device)
        kl_R = ([o - r for o, r in zip(old_logprobs, ref_logprobs)]
                if ref_logprobs is not None and old_logprobs is not None else None)
        rewards = token_rewards(rollouts, kl_R=kl_R, kl_coef=cfg.algorithm.kl_in_reward_coef)
        values = returns = None
        if cfg.algorithm.adv_estimator == "gae":
            values = critic_values(models.critic, rollouts, token_budget=budget, device=device)
            advantages, returns = gae_targets(rewards, values, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                                              whiten_advantages=cfg.algorithm.whiten_advantages,
                                              sum_across_ranks=world.all_reduce_sum)
        else:
            advantages = group_targets(rollouts, estimator=cfg.algorithm.adv_estimator,
                                       norm_by_std=cfg.algorithm.norm_adv_by_std)
            if models.critic is not None:
                if not self.skip_old_passes:  # else the first update forward's detached values are the old values
                    values = critic_values(models.critic, rollouts, token_budget=budget, device=device)
                returns = [reward_to_go(r) for r in rewards]
        targets = []
        for i in range(len(rollouts)):
            targets.append(SeqTargets(
                old_logprobs=old_logprobs[i] if old_logprobs is not None else None, advantages=advantages[i],
                ref_logprobs=ref_logprobs[i] if ref_logprobs is not None else None,
                old_values=values[i] if values is not None else None,
                returns=returns[i] if returns is not None else None,
            ))
        on_policy = all(b is None for b in behaviour)
        return targets, {"on_policy": on_policy}

    # -- one step ----------------------------------------------------------------------------------------------------

    def minibatches(self, rollouts: list[Rollout], targets: list[SeqTargets]) -> list[MiniBatch]:
        """This rank's share of each mini-batch, by the groups' global indices."""
        per_mb = self.cfg.rollout.prompts_per_step // self.cfg.trainer.mini_batches_per_step
        batches = [MiniBatch([], [], []) for _ in range(self.cfg.trainer.mini_batches_per_step)]
        for rollout, target in zip(rollouts, targets):
            batch = batches[rollout.group // per_mb]
            batch.prompts.append(rollout.prompt_ids)
            batch.responses.append(rollout.response_ids)
            batch.targets.append(target)
        return batches

    def rollout_metrics(self, rollouts: list[Rollout]) -> Metrics:
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
        truncated = torch.tensor([float(r.truncated) for r in rollouts], dtype=torch.float64)
        valid = torch.ones_like(rewards, dtype=torch.bool)
        return reduce_metrics(Metrics({
            "reward/mean": Mean.of(rewards, valid),
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
                 "loss/global_num_seqs": []}
        guard_value = None
        for epoch in range(cfg.algorithm.ppo_epochs):
            for index, batch in enumerate(batches):
                metrics, outcome = update_on_minibatch(
                    models.policy, models.policy_optimizer, batch, loss_fn=packed_policy_loss,
                    settings=self.policy_settings, grad_clip=cfg.trainer.grad_clip, guard=self.policy_guard,
                    **common)
                if epoch == 0 and index == 0 and on_policy:
                    values = finalize(metrics)
                    deviations = [abs(values[k] - 1.0) for k in ("probs_ratio_min", "probs_ratio_max") if k in values]
                    guard_value = max(deviations) if deviations else None
                collected.append(close_minibatch(metrics.prefixed("actor/")))
                facts["actor/grad_norm"].append(outcome.grad_norm)
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
        """This rank's model FLOPs of the step (docs/performance.md), by the passes the step ran."""
        cfg, models = self.cfg, self.models
        epochs = cfg.algorithm.ppo_epochs
        critic_pass = models.critic is not None and (cfg.algorithm.adv_estimator == "gae" or not self.skip_old_passes)
        return step_flops(models.policy.config, [len(r.prompt_ids) for r in rollouts],
                          [len(r.response_ids) for r in rollouts], generated=isinstance(self.source, TaskSource),
                          policy_forwards=int(not self.skip_old_passes) + int(models.reference is not None),
                          critic_forwards=int(critic_pass), policy_updates=epochs,
                          critic_updates=epochs if models.critic is not None else 0)

    def run_step(self, step: int) -> dict[str, float]:
        """One training step on every rank; returns the finalised metrics (the same on every rank)."""
        rank, world_size = self.info.rank, self.info.world_size
        with StepTimer() as timer:
            rollouts = self.source.rollouts(self.models, step, rank=rank, world_size=world_size, device=self.device)
            with phase("experience"):
                targets, facts = self.make_experience(rollouts)
            batches = self.minibatches(rollouts, targets)
            with phase("update"):
                update_metrics, update_facts = self.update(batches, facts["on_policy"])
            for scheduler in (self.models.policy_scheduler, self.models.critic_scheduler):
                if scheduler is not None:
                    scheduler.step()
            metrics = merge_all([self.rollout_metrics(rollouts), update_metrics])
        result = {"step": step, **finalize(metrics), **update_facts, **timer.metrics()}
        result.update(throughput(timer.metrics(), result=result, update_epochs=self.cfg.algorithm.ppo_epochs,
                                 step_flops_local=self.step_flops(rollouts), peak=self.peak_tflops,
                                 device=self.device, world_size=world_size))
        result["actor/lr"] = self.models.policy_optimizer.param_groups[0]["lr"]
        result["loss/loss_scale_factor"] = self.loss_scale_factor
        result["train/nonfinite_skipped"] = self.policy_guard.num_skipped + self.critic_guard.num_skipped
        return result


def skips_old_passes(cfg: DictConfig) -> bool:
    """Whether the old log-prob pass (and the critic's old-value pass when GAE does not need the values) can be
    skipped exactly: one epoch of one mini-batch, so the first update forward sees the weights that generated the
    experience; no behaviour log-probs from data; and no KL-in-reward (it reads the old log-probs before the update)."""
    return (cfg.algorithm.recompute_old_logprobs == "auto" and cfg.algorithm.ppo_epochs == 1
            and cfg.trainer.mini_batches_per_step == 1 and cfg.data.source == "task"
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
    start = resume(trainer, run_path)
    metrics_path = run_path / "metrics.jsonl"
    if info.is_main:
        run_path.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_path / "config.yaml")
        keep_metrics_before(metrics_path, start)
    print_start_report(trainer)
    eval_rewards: dict[int, float] = {}
    evaluate = cfg.trainer.eval_every > 0 and isinstance(trainer.source, TaskSource)
    if evaluate and start == 0:
        eval_rewards[0] = trainer.source.eval_reward(trainer.models, rank=info.rank, world_size=info.world_size,
                                                     device=trainer.device)
    history = []
    tensorboard = open_tensorboard(cfg, run_path)
    show = info.is_main and cfg.logging.progress
    from rich.progress import Progress

    with Progress(*progress_columns(), disable=not show, transient=False) as progress:
        task = progress.add_task("train", total=cfg.trainer.steps, completed=start, stats="")
        for step in range(start, cfg.trainer.steps):
            result = trainer.run_step(step)
            done = step + 1
            if evaluate and (done % cfg.trainer.eval_every == 0 or done == cfg.trainer.steps):
                eval_rewards[done] = trainer.source.eval_reward(trainer.models, rank=info.rank,
                                                                world_size=info.world_size, device=trainer.device)
                result["eval/reward"] = eval_rewards[done]
            history.append(result)
            if info.is_main:
                write_metrics_line(metrics_path, result)
                write_tensorboard(tensorboard, result)
            progress.update(task, advance=1, stats=stats_line(result))
            stopping = world.any_flag(stop.requested)
            every = cfg.checkpoint.every
            if stopping or (every > 0 and done % every == 0 and done < cfg.trainer.steps):
                path = save(trainer, run_path, done)
            if stopping:
                where = (f"trainer.run_dir={run_path}" if cfg.trainer.run_dir is not None else
                         f"trainer.run_name={run_path.name}")
                log(f"interrupted: saved checkpoint {path.name} in {path.parent}; resume with {where} "
                    "trainer.resume=auto")
                world.destroy_distributed()
                return 0
    if cfg.checkpoint.every > 0 and start < cfg.trainer.steps:  # else the resumed checkpoint is this one
        save(trainer, run_path, cfg.trainer.steps)
    export(trainer, run_path)
    if info.is_main and history:
        print_summary(history, eval_rewards)
    log(f"run directory: {run_dir} (metrics.jsonl, export/)")
    world.destroy_distributed()
    return 0
