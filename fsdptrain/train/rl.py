"""The training recipe: rollouts -> experience -> epochs x mini-batches of the FSDP2 update -> reduce -> log ->
checkpoint.

:meth:`Trainer.run_step` reads top to bottom as the data path of docs/architecture.md and calls components only:
the rollout source (fsdptrain/rollout/rollout_source.py), the experience passes (experience.py), the update of one
mini-batch (step.py), the collectives (fsdptrain/distributed/collectives.py). The run flow shared with the SFT
recipe (fsdptrain/run/runner.py: resume, the metrics lines, checkpoints, the export) drives it through the hooks
at the end of :class:`Trainer`. Set-up is split into ``build_*`` helpers. Every rank runs this code; rank 0 alone
prints and writes the run directory.

Optional features plug in as an :class:`Extension` (docs/architecture.md, "Extensions"): :func:`build_extensions` is
their one registration. The policy and the critic are trained parts (trained_part.py: a model with its optimizer,
schedule, guard, watch and loss), which the update loops over. Every stateful part (the trained parts' models,
optimizers, schedulers, guards and watches, the source, the extensions) saves and restores itself through
``state_dict()`` / ``load_state_dict()``; :meth:`Trainer.checkpointed` lists them for the checkpointer.

Prompt groups are owned by rank ``index % world_size`` and belong to mini-batch ``index // (P / M)``, both fixed by
the group's global index within the step, so the mini-batches hold the same data at any world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import torch
from omegaconf import DictConfig

from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.distributed.context_parallel import build_context_group, group_rollouts
from fsdptrain.distributed.placement import bridge
from fsdptrain.distributed.weight_handover import Sent, WeightSender
from fsdptrain.generation.schedule import sent_versions
from fsdptrain.metrics.typed import Diagnostic, Max, Mean, Metrics, Sum, close_minibatch, finalize, merge_all
from fsdptrain.model.loading import DTYPES, build_tokenizer
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.rollout.generator_rank import serve
from fsdptrain.rollout.rollout_source import build_source
from fsdptrain.run.checkpointer import Checkpointed, export_hf_models
from fsdptrain.run.console import print_samples, print_start_report, print_summary
from fsdptrain.run.outputs import write_samples
from fsdptrain.run.perf import StepTimer, peak_tflops, phase, step_flops, throughput
from fsdptrain.run.runner import resolve_steps, run_recipe
from fsdptrain.train.drafter_setup import DrafterExtension
from fsdptrain.train.experience import experience_settings, make_targets
from fsdptrain.train.group_filter import filter_groups
from fsdptrain.train.setup import (
    build_models,
    loss_scale_factor,
    max_response_length,
    resolve_device_type,
    skips_old_passes,
    value_settings,
)
from fsdptrain.train.step import AuxiliaryLoss, MiniBatch, replica_metrics
from fsdptrain.train.trained_part import checkpointed_parts


class Extension(Protocol):
    """An optional feature of the train step (docs/architecture.md, "Extensions").

    It sees each step's rollouts, may train an auxiliary loss on the policy's forward (the hook of
    `fsdptrain.train.step.AuxiliaryLoss`: the same forward's captures, the same backward, its own optimizer step),
    adds its models, optimizers, schedulers and state to the checkpoint, logs typed facts, and exports itself. Every
    method is called on every rank in the same order (they may be collective).
    """

    name: str
    """Its key in the checkpoint's states."""

    def on_rollouts(self, step: int, rollouts: list[Rollout]) -> None: ...

    def auxiliary_loss(self) -> Optional[AuxiliaryLoss]:
        """Its auxiliary loss for this step's update, or None (not trained this step)."""

    def extra_policy_forwards(self, epochs: int) -> int:
        """Policy forwards it adds to one step (perf's FLOPs)."""

    def parts(self) -> tuple[dict, dict, dict]:
        """Its (models, optimizers, schedulers) by name, saved with the policy's."""

    def prepare_to_load(self, saved_models: list[str]) -> None:
        """Build what a checkpoint holding ``saved_models`` will load into."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def step_facts(self) -> Metrics:
        """Typed metrics of the step, the same on every rank."""

    def export(self, run_dir: Path) -> None: ...


def build_extensions(cfg: DictConfig, models, *, mesh, device: torch.device, num_steps: int) -> list[Extension]:
    """The extensions the config turns on: their one registration."""
    extensions: list[Extension] = []
    if cfg.drafter.enabled:
        extensions.append(DrafterExtension(cfg, models.policy, mesh=mesh, device=device, backend=models.backend,
                                           num_steps=num_steps))
    return extensions


class Trainer:
    """Owns the models, the rollout source, the extensions and the run directory for one ``fsdptrain train`` run;
    the RL recipe of the shared run flow (`fsdptrain.run.runner.Recipe`)."""

    name = "train"
    stats = (("reward/mean", "reward", ".3f"), ("perf/tokens_per_s", "tok/s", ".0f"), ("perf/step_s", "step", ".2f"),
             ("perf/generate_s", "gen", ".2f"), ("perf/experience_s", "exp", ".2f"), ("perf/update_s", "upd", ".2f"),
             ("actor/pg_loss", "pg", ".3g"), ("critic/vf_loss", "vf", ".3g"), ("actor/grad_norm", "|g|", ".3g"),
             ("async/staleness", "stale", ".0f"), ("perf/trainer_wait_s", "wait", ".2f"))

    def __init__(self, cfg: DictConfig, run_dir: Path, info: world.DistInfo, mesh):
        self.cfg, self.run_dir, self.info, self.mesh = cfg, run_dir, info, mesh
        self.device = info.device
        self.dp_size = world.dp_size(mesh)
        self.context = build_context_group(cfg.parallel.cp)
        """This rank's CP group (docs/scaling.md): its ranks train the union of their rollouts, each row split."""
        self.tokenizer = build_tokenizer(cfg)
        self.source = build_source(cfg, self.tokenizer)
        self.num_steps = resolve_steps(cfg, self.source.num_train_rows,
                                       rows_per_step=cfg.rollout.prompts_per_step)
        self.models = build_models(cfg, self.tokenizer, mesh, self.device, num_steps=self.num_steps)
        self.policy_settings = self.models.policy_part.settings
        self.experience_settings = experience_settings(cfg, share_prompts=self.models.share_prompts)
        self.value_settings = value_settings(cfg)
        self.loss_scale_factor = loss_scale_factor(cfg)
        self.skip_old_passes = skips_old_passes(cfg)
        self.peak_tflops = peak_tflops(cfg.perf.peak_tflops, self.device)
        self.kinds: dict[str, str] = {}
        """The kind of every typed metric logged so far (``Kind`` values)."""
        self.eval_rewards: dict[int, float] = {}
        """``eval/reward`` after each number of steps this run evaluated at, for the summary."""
        self.extensions = build_extensions(cfg, self.models, mesh=mesh, device=self.device, num_steps=self.num_steps)
        self.weights: Optional[WeightSender] = None
        """With ``rollout.placement=separate``: the policy's weights to the generators after each step."""
        self.sent_versions = range(0)
        if self.source.link is not None:
            self.weights = WeightSender(self.models.policy, bridge(), param_dtype=DTYPES[cfg.parallel.param_dtype],
                                        bucket_bytes=cfg.rollout.weight_bucket_mb * 2**20)

    # -- one step ----------------------------------------------------------------------------------------------------

    def run_step(self, step: int) -> dict[str, float]:
        """One training step on every rank; returns the finalised metrics (the same on every rank)."""
        with StepTimer() as timer:
            rollouts, filter_metrics = self.step_rollouts(step)  # generation and rewards
            if world.agree_max_int(len(rollouts)) == 0:
                raise RuntimeError(f"step {step}: no prompt group with a reward signal after "
                                   f"{self.cfg.algorithm.filter_groups_max_rounds} round(s) of dynamic sampling: "
                                   "raise algorithm.filter_groups_max_rounds or rollout.prompts_per_step")
            for extension in self.extensions:
                extension.on_rollouts(step, rollouts)
            trained = group_rollouts(rollouts, self.context)  # this rank's own without context parallelism
            with phase("experience"):
                targets, experience = self.make_experience(trained)
            batches = self.minibatches(trained, targets)
            with phase("update"):
                update_metrics, update_facts = self.update(batches, experience["on_policy"])
            for scheduler in self.checkpointed().schedulers.values():
                scheduler.step()
            sent = self.send_weights(step + 1)
            experience_metrics = merge_all([filter_metrics, replica_metrics(experience["metrics"], self.context)])
            if experience_metrics:  # names fixed by the config
                experience_metrics = reduce_metrics(experience_metrics)
            metrics = merge_all([self.rollout_metrics(rollouts, self.source.step_metrics), experience_metrics,
                                 update_metrics, update_facts, self.step_facts(sent)])
        result = {"step": step, **finalize(metrics)}
        perf = merge_all([timer.metrics(), throughput(
            timer.timings(), result=result, update_epochs=self.cfg.algorithm.ppo_epochs,
            step_flops_local=self.step_flops(rollouts), peak=self.peak_tflops, device=self.device,
            world_size=self.info.world_size)])
        evaluation = self.evaluate_if_due(step + 1)
        result.update(finalize(merge_all([perf, evaluation])))
        self.kinds.update((name, metric.kind.value) for group in (metrics, perf, evaluation)
                          for name, metric in group.items())
        return result

    # -- the step's components ---------------------------------------------------------------------------------------

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

    def make_experience(self, rollouts: list[Rollout]) -> tuple[list[SeqTargets], dict]:
        """Old/ref log-probs, values, rewards, advantages and weights for this rank's rollouts (collective passes);
        facts: ``on_policy`` and this rank's experience ``metrics``."""
        targets, on_policy, metrics = make_targets(self.models, rollouts, self.experience_settings,
                                                   device=self.device, skip_old_passes=self.skip_old_passes,
                                                   replica=self.context.rank != 0)
        return targets, {"on_policy": on_policy, "metrics": metrics}

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
            batch.routes.append(rollout.routes)
        return batches

    def rollout_metrics(self, rollouts: list[Rollout], reward_metrics: Metrics | None = None) -> Metrics:
        """The step's rollout metrics over all ranks; ``reward_metrics`` (the reward functions', which hold
        ``reward/mean``) replace the plain reward mean when the source scored the rollouts itself.
        ``response_length/*`` count the policy's tokens (the rollout's ``response_mask``); ``batch/num_response_tokens``
        counts every response token, a tool's included (what the forwards process)."""
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        lengths = torch.tensor([policy_length(r) for r in rollouts], dtype=torch.float64)
        all_lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float64)
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
            "batch/num_response_tokens": Sum(float(all_lengths.sum())),
            "batch/num_prompt_tokens": Sum(float(sum(len(r.prompt_ids) for r in rollouts))),
        }))

    def auxiliary_loss(self) -> Optional[AuxiliaryLoss]:
        """The auxiliary loss trained with the policy this step (at most one extension's)."""
        losses = [a for a in (e.auxiliary_loss() for e in self.extensions) if a is not None]
        assert len(losses) <= 1, "one auxiliary loss on the policy's forward at a time"
        return losses[0] if losses else None

    def update(self, batches: list[MiniBatch], on_policy: bool) -> tuple[Metrics, Metrics]:
        """Epochs x mini-batches x the trained parts (the policy's, then the critic's): the merged metrics of the
        losses, and the typed facts of the optimizer steps (grad norms and global counts: MEANs over the step's
        optimizer steps, the same on every rank; the on-policy check: a MAX)."""
        cfg, models = self.cfg, self.models
        layout = dict(dp_size=self.dp_size, loss_scale_factor=self.loss_scale_factor,
                      token_budget=cfg.trainer.token_budget, device=self.device,
                      share_prompts=models.share_prompts, context=self.context)
        auxiliary = self.auxiliary_loss()
        collected, facts = [], []
        for epoch in range(cfg.algorithm.ppo_epochs):
            for index, batch in enumerate(batches):
                for part in models.trained:
                    is_policy = part is models.policy_part  # the auxiliary loss rides on the policy's forward
                    metrics, outcome = part.update(batch, auxiliary=auxiliary if is_policy else None, **layout)
                    if is_policy and epoch == 0 and index == 0 and on_policy:
                        facts.append(on_policy_deviation(finalize(metrics)))
                    collected.append(close_minibatch(part.named(metrics)))
                    facts.append(part.facts(outcome))
        return merge_all(collected), merge_all(facts)

    def send_weights(self, version: int, *, full: bool = False) -> Optional[Sent]:
        """With ``rollout.placement=separate``: version ``version`` of the policy to the generators, when a step
        they generate needs it (fsdptrain/generation/schedule.py; collective over the trainer ranks); what was sent,
        or None."""
        if self.weights is not None and version in self.sent_versions:
            return self.weights.send(version, full=full)
        return None

    def step_facts(self, sent: Optional[Sent] = None) -> Metrics:
        """The step's settings and run totals, the same on every rank (so MAX over ranks is the value): the policy's
        learning rate (after this step's scheduler step), the loss scale factor, the optimizer steps skipped so far;
        with separate placement the bytes of the weights sent after the step (trainer rank 0's; 0 elsewhere) and
        their time; then the source's and the extensions' facts."""
        own = Metrics({"actor/lr": Max(self.models.policy_part.lr),
                       "loss/loss_scale_factor": Max(self.loss_scale_factor),
                       "train/nonfinite_skipped": Max(sum(part.guard.num_skipped for part in self.models.trained))})
        if self.weights is not None:  # ``sent``: the weights sent after this step, if any
            own = own.merge(Metrics({"async/broadcast_bytes": Max(sent.bytes if sent else 0),
                                     "perf/broadcast_s": Diagnostic(Max(sent.seconds if sent else 0.0))}))
        return merge_all([own, self.source.step_facts(), *(e.step_facts() for e in self.extensions)])

    def evaluate_if_due(self, done: int) -> Metrics:
        """``eval/reward`` (the greedy mean reward over the evaluation rows, reduced over ranks) after ``done`` steps
        when ``trainer.eval_every`` says so, and with ``trainer.eval_n`` > 1 the sampled ``eval/pass@k``,
        ``eval/mean@n`` and ``eval/maj@n`` (docs/evaluation.md), reduced over ranks (collective)."""
        every = self.cfg.trainer.eval_every
        if not (self.can_evaluate() and (done % every == 0 or done == self.num_steps)):
            return Metrics()
        greedy = Metrics({"eval/reward": Mean(self.evaluate(), 1)})
        if self.cfg.trainer.eval_n == 1:
            return greedy
        sampled = self.source.eval_samples(self.models, step=done, rank=self.info.rank,
                                           world_size=self.info.world_size, device=self.device)
        return merge_all([greedy, reduce_metrics(sampled)])

    def can_evaluate(self) -> bool:
        return self.cfg.trainer.eval_every > 0 and self.source.can_evaluate()

    def evaluate(self) -> float:
        return self.source.eval_reward(self.models, rank=self.info.rank, world_size=self.info.world_size,
                                       device=self.device)

    def step_flops(self, rollouts: list[Rollout]) -> float:
        """This rank's model FLOPs of the step (docs/performance.md), by the passes the step ran (an extension's
        extra policy forwards included; its own model's FLOPs are not counted)."""
        cfg, models = self.cfg, self.models
        epochs = cfg.algorithm.ppo_epochs
        extra_forwards = sum(e.extra_policy_forwards(epochs) for e in self.extensions)
        critic_pass = models.critic is not None and (cfg.algorithm.adv_estimator == "gae"
                                                     or not self.skip_old_passes)
        return step_flops(models.policy.config, [len(r.prompt_ids) for r in rollouts],
                          [len(r.response_ids) for r in rollouts], generated=self.source.generates,
                          policy_forwards=(int(not self.skip_old_passes) + int(models.reference is not None)
                                           + extra_forwards),
                          critic_forwards=int(critic_pass), policy_updates=epochs,
                          critic_updates=epochs if models.critic is not None else 0)

    # -- state -------------------------------------------------------------------------------------------------------

    def checkpointed(self) -> Checkpointed:
        """Every stateful part of the run, by name, for the checkpointer (docs/checkpointing.md)."""
        parts = checkpointed_parts(self.models.trained, states={"source": self.source})
        for extension in self.extensions:
            models, optimizers, schedulers = extension.parts()
            parts.models.update(models)
            parts.optimizers.update(optimizers)
            parts.schedulers.update(schedulers)
            parts.states[extension.name] = extension
        return parts

    def prepare_to_load(self, saved_models: list[str]) -> None:
        for extension in self.extensions:
            extension.prepare_to_load(saved_models)

    def export(self, run_dir: Path) -> None:
        """The final models as Hugging Face folders, and each extension's export (collective)."""
        export_hf_models(run_dir, policy=self.models.policy, critic=self.models.critic, tokenizer=self.tokenizer,
                         base_path=self.cfg.model.path)
        for extension in self.extensions:
            extension.export(run_dir)

    # -- the run flow's hooks (fsdptrain/run/runner.py) --------------------------------------------------------------

    def report_start(self) -> None:
        cfg, models = self.cfg, self.models
        print_start_report(cfg, world_size=self.info.world_size, device=self.device, mesh_shape=tuple(self.mesh.shape),
                           backend=models.backend, policy=models.policy, dp_size=self.dp_size,
                           share_prompts=("on" if models.share_prompts else "off") + f" ({models.share_prompts_why})",
                           loss_scale_factor=self.loss_scale_factor, max_len=max_response_length(cfg),
                           source_line=self.source.describe(self.num_steps))

    def begin(self, start: int) -> None:
        """A fresh run's ``eval/reward`` before any step (collective); with separate placement, the generators learn
        where the run starts and get its first version of the weights."""
        if self.can_evaluate() and start == 0:
            self.eval_rewards[0] = self.evaluate()
        if self.source.link is not None:
            k = self.cfg.rollout.max_staleness
            self.sent_versions = sent_versions(start, k, self.num_steps)
            self.source.link.begin(start, self.num_steps)
            self.send_weights(start, full=True)

    def after_step(self, step: int, result: dict[str, float], *, first: bool, console) -> None:
        """Keeps the step's ``eval/reward`` for the summary; rank 0 writes samples.jsonl every
        ``logging.samples_every`` steps and shows the run's first samples."""
        if "eval/reward" in result:
            self.eval_rewards[step + 1] = result["eval/reward"]
        samples, every = self.source.samples, self.cfg.logging.samples_every
        if not (self.info.is_main and samples):
            return
        if every > 0 and step % every == 0:
            write_samples(self.run_dir / "samples.jsonl", step, samples)
        if first:
            print_samples(console, step, samples)

    def summarize(self, history: list[dict[str, float]]) -> None:
        if self.info.is_main:
            print_summary(history, self.eval_rewards)

    def close(self) -> None:
        """The source's reward worker processes end."""
        self.source.close()


def policy_length(rollout: Rollout) -> int:
    """The rollout's response tokens the policy sampled: the sum of its ``response_mask`` (its length without one)."""
    return len(rollout.response_ids) if rollout.response_mask is None else int(sum(rollout.response_mask))


def on_policy_deviation(values: dict[str, float]) -> Metrics:
    """``actor/on_policy_max_ratio_dev``: max |ratio - 1| over the first on-policy mini-batch (the ratios must be 1
    there: a check of the experience pass); absent when the ratio extrema are."""
    deviations = [abs(values[k] - 1.0) for k in ("probs_ratio_min", "probs_ratio_max") if k in values]
    return Metrics({"actor/on_policy_max_ratio_dev": Max(max(deviations))}) if deviations else Metrics()


# ---- the run --------------------------------------------------------------------------------------------------------


def train(cfg: DictConfig, run_dir: str) -> int:
    """The ``fsdptrain train`` job on this rank (the shared run flow over :class:`Trainer`); returns the exit code.
    With ``rollout.placement=separate`` the last ``rollout.generator_ranks`` ranks serve as generators instead
    (fsdptrain/rollout/generator_rank.py; docs/async.md)."""
    device_type = resolve_device_type(cfg)
    if cfg.rollout.placement == "separate":
        world.init_distributed(device_type=device_type, generator_ranks=cfg.rollout.generator_ranks,
                               generator_timeout_s=cfg.rollout.generator_timeout_s)
        if bridge().placement.is_generator:
            return serve(cfg, bridge())
    return run_recipe(cfg, run_dir, Trainer, device_type=device_type)
