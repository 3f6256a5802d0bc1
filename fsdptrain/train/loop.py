"""The training loop: rollouts -> experience -> epochs x mini-batches of the FSDP2 update -> metrics -> log.

Set-up is split into ``build_*`` helpers; :meth:`Trainer.run_step` reads top to bottom as the design's data path
(section 2). Every rank runs this code; rank 0 alone prints and writes the run directory.

Prompt groups are owned by rank ``index % world_size`` and belong to mini-batch ``index // (P / M)``, both fixed by
the group's global index within the step, so the mini-batches hold the same data at any world size.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.distributed import world
from fsdptrain.model.attention import generation_attention, resolve_backend, set_attention
from fsdptrain.distributed.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fsdptrain.config import ConfigError, validate_world
from fsdptrain.data.offline import get_task, load_jsonl_rollouts, task_prompts
from fsdptrain.distributed.export import export_hf
from fsdptrain.train.experience import (
    critic_values,
    gae_targets,
    group_targets,
    policy_logprobs,
    reward_to_go,
    token_rewards,
)
from fsdptrain.rl.grad_scale import grad_scale_report
from fsdptrain.train.packed_loss import (
    PolicyLossSettings,
    SeqTargets,
    ValueLossSettings,
    packed_policy_loss,
    packed_value_loss,
)
from fsdptrain.rl.metrics import Diagnostic, Max, Mean, Metrics, Sum, close_minibatch, finalize, merge_all
from fsdptrain.distributed.fsdp import build_policy, build_reference_model, build_value_model, describe_model_memory
from fsdptrain.train.optim import NonFiniteGuard, build_optimizer, build_scheduler
from fsdptrain.data.rollout import Rollout, generate_responses
from fsdptrain.data.tasks import reward as task_reward
from fsdptrain.train.step import MiniBatch, reduce_metrics, update_on_minibatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAD_NORM_WARN_STEPS = 5


def log(message: str) -> None:
    """Print on rank 0 only."""
    if dist_rank() == 0:
        print(message, flush=True)


def dist_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


# ---- set-up -------------------------------------------------------------------------------------------------------


def build_tokenizer(cfg: DictConfig):
    """The bundled tokenizer, or the one in the user's model folder (left padding; pad falls back to EOS)."""
    if cfg.model.path is None:
        from fsdptrain.data.tokenizer import load_bundled_tokenizer

        return load_bundled_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_model_config(cfg: DictConfig, tokenizer) -> dict:
    """The config-built model's transformers config, sized to the tokenizer."""
    return {
        "model_type": cfg.model.arch,
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.model.hidden_size,
        "intermediate_size": cfg.model.intermediate_size,
        "num_hidden_layers": cfg.model.num_layers,
        "num_attention_heads": cfg.model.num_heads,
        "num_key_value_heads": cfg.model.num_kv_heads,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": cfg.model.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def max_response_length(cfg: DictConfig) -> int:
    return cfg.data.max_response_length if cfg.data.source == "jsonl" else cfg.rollout.max_new_tokens


def loss_scale_factor(cfg: DictConfig) -> float:
    """The -norm constant: configured, else the configured maximum response length (never a packed row length)."""
    return float(cfg.loss.loss_scale_factor) if cfg.loss.loss_scale_factor is not None else float(
        max_response_length(cfg))


def needs_reference(cfg: DictConfig) -> bool:
    return cfg.algorithm.use_kl_loss or cfg.algorithm.kl_in_reward_coef > 0


@dataclass
class Models:
    policy: torch.nn.Module
    policy_optimizer: torch.optim.Optimizer
    policy_scheduler: object
    critic: Optional[torch.nn.Module] = None
    critic_optimizer: Optional[torch.optim.Optimizer] = None
    critic_scheduler: Optional[object] = None
    reference: Optional[torch.nn.Module] = None
    backend: str = "sdpa_segments"


def build_models(cfg: DictConfig, tokenizer, mesh, device: torch.device) -> Models:
    """Policy, optional critic and reference, sharded over ``mesh``, switched to the packed attention backend."""
    source = dict(path=cfg.model.path, config=None if cfg.model.path else tiny_model_config(cfg, tokenizer))
    parallel = dict(mesh=mesh, param_dtype=_DTYPES[cfg.parallel.param_dtype],
                    reduce_dtype=_DTYPES[cfg.parallel.reduce_dtype],
                    reshard_after_forward=cfg.parallel.reshard_after_forward,
                    cpu_offload=cfg.parallel.cpu_offload)
    seed = cfg.trainer.seed
    policy = build_policy(**source, **parallel, seed=seed, activation_checkpointing=cfg.parallel.activation_checkpointing)
    backend = resolve_backend(cfg.model.attn_backend, device, _DTYPES[cfg.parallel.param_dtype])
    set_attention(policy, backend)
    total_steps = cfg.trainer.steps
    schedule = dict(warmup_steps=cfg.trainer.warmup_steps, total_steps=total_steps,
                    schedule=cfg.trainer.lr_schedule, min_lr_ratio=cfg.trainer.min_lr_ratio)
    optimizer = build_optimizer(policy, lr=cfg.trainer.lr, betas=(0.9, 0.999), weight_decay=cfg.trainer.weight_decay,
                                eps=1e-8)
    models = Models(policy=policy, policy_optimizer=optimizer, policy_scheduler=build_scheduler(optimizer, **schedule),
                    backend=backend)
    if cfg.algorithm.use_critic:
        backbone = {}
        if cfg.model.value_init == "policy":
            backbone = (dict(backbone_from_path=cfg.model.path) if cfg.model.path else
                        dict(backbone_from_config=source["config"], backbone_seed=seed))
        critic = build_value_model(**source, **parallel, seed=seed + 1,
                                   activation_checkpointing=cfg.parallel.activation_checkpointing, **backbone)
        set_attention(critic, backend)
        critic_opt = build_optimizer(critic, lr=cfg.trainer.critic_lr, betas=(0.9, 0.999),
                                     weight_decay=cfg.trainer.weight_decay, eps=1e-8)
        models.critic, models.critic_optimizer = critic, critic_opt
        models.critic_scheduler = build_scheduler(critic_opt, **schedule)
    if needs_reference(cfg):
        reference = build_reference_model(**source, **parallel, seed=seed)
        set_attention(reference, backend)
        models.reference = reference
    return models


def policy_settings(cfg: DictConfig) -> PolicyLossSettings:
    alg = cfg.algorithm
    return PolicyLossSettings(
        agg_mode=cfg.loss.agg_mode, clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high,
        clip_ratio_c=alg.clip_ratio_c, seq_level_ratio=alg.seq_level_ratio, kl_coef=alg.kl_loss_coef,
        kl_estimator=alg.kl_estimator, entropy_coef=alg.entropy_coef, temperature=cfg.rollout.temperature,
        chunk_size=cfg.loss.logprob_chunk_size, use_reference=bool(alg.use_kl_loss),
    )


def value_settings(cfg: DictConfig) -> ValueLossSettings:
    return ValueLossSettings(agg_mode=cfg.loss.agg_mode, cliprange_value=cfg.algorithm.cliprange_value)


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """A rank's sampling seed for a step: reproducible across runs and resumes, different across ranks."""
    return (seed * 1_000_003 + step * 1_009 + rank) % (2**31)


# ---- experience sources ---------------------------------------------------------------------------------------------


class TaskSource:
    """The bundled task: each step's prompts from the seed, ``n`` samples each, generated by the policy."""

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.task = get_task(cfg.data.task)
        self.max_response_length = cfg.rollout.max_new_tokens

    def rollouts(self, models: Models, step: int, *, rank: int, world_size: int, device) -> list[Rollout]:
        cfg = self.cfg
        groups = task_prompts(self.task, seed=cfg.data.seed, step=step, num_prompts=cfg.rollout.prompts_per_step)
        mine = [g for g in groups if g.index % world_size == rank]
        texts = [g.text for g in mine for _ in range(cfg.rollout.n)]
        with generation_attention(models.policy):
            outputs = generate_responses(
                models.policy, self.tokenizer, texts, max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, do_sample=True,
                generator_seed=sampling_seed(cfg.trainer.seed, step, rank), device=device,
            )
        rollouts = []
        for k, (prompt_ids, response_ids, truncated) in enumerate(outputs):
            group = mine[k // cfg.rollout.n]
            text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
            rollouts.append(Rollout(prompt_ids=prompt_ids, response_ids=response_ids,
                                    reward=task_reward(text, group.answer), group=group.index, truncated=truncated,
                                    prompt_text=group.text, response_text=text))
        return rollouts

    @torch.no_grad()
    def eval_reward(self, models: Models, *, rank: int, world_size: int, device) -> float:
        """Greedy mean reward over the held-out prompts (the same prompts every time), averaged over ranks."""
        cfg = self.cfg
        groups = task_prompts(self.task, seed=cfg.data.seed, step=0, num_prompts=cfg.data.num_eval_prompts,
                              stream="eval")
        mine = [g for g in groups if g.index % world_size == rank]
        total = 0.0
        with generation_attention(models.policy):
            outputs = generate_responses(
                models.policy, self.tokenizer, [g.text for g in mine],
                max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, top_p=1.0, do_sample=False,
                generator_seed=0, device=device)
        for g, (_, response_ids, _) in zip(mine, outputs):
            total += task_reward(self.tokenizer.decode(response_ids, skip_special_tokens=True), g.answer)
        sums = world.all_reduce_sum(torch.tensor([total, float(len(mine))], dtype=torch.float64))
        return float(sums[0] / sums[1])


class OfflineSource:
    """Offline JSONL rollouts: each step takes the next ``prompts_per_step`` groups, cycling over the file."""

    def __init__(self, cfg: DictConfig, tokenizer):
        self.cfg = cfg
        rollouts, self.num_skipped = load_jsonl_rollouts(cfg.data.path, tokenizer,
                                                         max_response_length=cfg.data.max_response_length,
                                                         skip_bad_rows=cfg.data.skip_bad_rows)
        self.groups: dict[int, list[Rollout]] = {}
        for r in rollouts:
            self.groups.setdefault(r.group, []).append(r)
        self.max_response_length = cfg.data.max_response_length

    def rollouts(self, models: Models, step: int, *, rank: int, world_size: int, device) -> list[Rollout]:
        per_step = self.cfg.rollout.prompts_per_step
        out = []
        for index in range(per_step):
            if index % world_size != rank:
                continue
            source_group = (step * per_step + index) % len(self.groups)
            for r in self.groups[source_group]:
                out.append(Rollout(prompt_ids=r.prompt_ids, response_ids=r.response_ids, reward=r.reward,
                                   group=index, truncated=r.truncated, behaviour_logprobs=r.behaviour_logprobs,
                                   prompt_text=r.prompt_text, response_text=r.response_text))
        return out


# ---- the loop -------------------------------------------------------------------------------------------------------


@dataclass
class GradNormWatch:
    """Warns when the pre-clip grad norm stays above ``factor x clip`` for several steps in a row."""

    factor: float
    clip: float
    name: str
    in_a_row: int = 0

    def observe(self, grad_norm: float) -> None:
        if self.clip <= 0:
            return
        self.in_a_row = self.in_a_row + 1 if grad_norm > self.factor * self.clip else 0
        if self.in_a_row == GRAD_NORM_WARN_STEPS:
            log(f"warning: {self.name} pre-clip grad norm has been above {self.factor:g} x grad_clip "
                f"({self.factor * self.clip:g}) for {GRAD_NORM_WARN_STEPS} steps (now {grad_norm:.4g}): clipping "
                f"dominates the update; lower the learning rate or use a mode whose scale is near 1")


@dataclass
class RunState:
    step: int = 0
    history: list = field(default_factory=list)


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
        self.state = RunState()

    # -- experience --------------------------------------------------------------------------------------------------

    def make_experience(self, rollouts: list[Rollout]) -> tuple[list[SeqTargets], dict[str, float]]:
        """Old/ref log-probs, values, rewards and advantages for this rank's rollouts (collective passes)."""
        cfg, models = self.cfg, self.models
        budget, device = cfg.trainer.token_budget, self.device
        chunk, temperature = cfg.loss.logprob_chunk_size, cfg.rollout.temperature
        old_logprobs = policy_logprobs(models.policy, rollouts, temperature=temperature, chunk_size=chunk,
                                       token_budget=budget, device=device)
        behaviour = [r.behaviour_logprobs for r in rollouts]
        if any(b is not None for b in behaviour):
            old_logprobs = [torch.tensor(b, dtype=torch.float32) if b is not None else lp
                            for b, lp in zip(behaviour, old_logprobs)]
        ref_logprobs = None
        if models.reference is not None:
            ref_logprobs = policy_logprobs(models.reference, rollouts, temperature=temperature, chunk_size=chunk,
                                           token_budget=budget, device=device)
        kl_R = [o - r for o, r in zip(old_logprobs, ref_logprobs)] if ref_logprobs is not None else None
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
                values = critic_values(models.critic, rollouts, token_budget=budget, device=device)
                returns = [reward_to_go(r) for r in rewards]
        targets = []
        for i in range(len(rollouts)):
            targets.append(SeqTargets(
                old_logprobs=old_logprobs[i], advantages=advantages[i],
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

    def run_step(self, step: int) -> dict[str, float]:
        """One training step on every rank; returns the finalised metrics (the same on every rank)."""
        start = time.perf_counter()
        rank, world_size = self.info.rank, self.info.world_size
        rollouts = self.source.rollouts(self.models, step, rank=rank, world_size=world_size, device=self.device)
        targets, facts = self.make_experience(rollouts)
        batches = self.minibatches(rollouts, targets)
        update_metrics, update_facts = self.update(batches, facts["on_policy"])
        for scheduler in (self.models.policy_scheduler, self.models.critic_scheduler):
            if scheduler is not None:
                scheduler.step()
        metrics = merge_all([self.rollout_metrics(rollouts), update_metrics])
        result = {"step": step, **finalize(metrics), **update_facts}
        elapsed = time.perf_counter() - start
        result["perf/step_time_s"] = elapsed
        result["perf/tokens_per_s"] = (result["batch/num_response_tokens"] + result["batch/num_prompt_tokens"]) / elapsed
        result["actor/lr"] = self.models.policy_optimizer.param_groups[0]["lr"]
        result["loss/loss_scale_factor"] = self.loss_scale_factor
        result["train/nonfinite_skipped"] = self.policy_guard.num_skipped + self.critic_guard.num_skipped
        return result


# ---- the run --------------------------------------------------------------------------------------------------------


def resolve_device_type(cfg: DictConfig) -> str:
    if cfg.trainer.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.trainer.device


def print_start_report(trainer: "Trainer") -> None:
    """Model sizes, the backend, and the gradient scale of the configured mode with its normalisation in words."""
    cfg = trainer.cfg
    log(f"fsdptrain: {trainer.info.world_size} rank(s) on {trainer.device.type}, mesh {tuple(trainer.mesh.shape)}, "
        f"packed attention: {trainer.models.backend}")
    log("policy: " + describe_model_memory(trainer.models.policy, num_shards=trainer.dp_size))
    seqs = cfg.rollout.prompts_per_step // cfg.trainer.mini_batches_per_step * (
        cfg.rollout.n if cfg.data.source == "task" else 1)
    max_len = max_response_length(cfg)
    if cfg.loss.loss_scale_factor is None and cfg.loss.agg_mode == "seq-mean-token-sum-norm":
        log(f"loss.loss_scale_factor is null: using the configured maximum response length {max_len}")
    report = grad_scale_report(cfg.loss.agg_mode, num_tokens=seqs * max_len, num_seqs=seqs,
                               seq_lengths=[max_len] * seqs, dp_size=trainer.dp_size,
                               loss_scale_factor=trainer.loss_scale_factor, grad_clip=cfg.trainer.grad_clip)
    log(f"normalisation (a mini-batch of {seqs} sequences at the maximum length {max_len}): " + report.describe())


def write_metrics_line(path: Path, result: dict) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(result) + "\n")


def open_tensorboard(cfg: DictConfig, run_dir: Path):
    """A SummaryWriter under ``run_dir/tensorboard`` when enabled and installed (rank 0 only), else None."""
    if not cfg.logging.tensorboard or dist_rank() != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log("warning: logging.tensorboard=true but the tensorboard package is not installed "
            "(pip install tensorboard); metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def write_tensorboard(writer, result: dict) -> None:
    if writer is None:
        return
    for key, value in result.items():
        if key != "step" and isinstance(value, (int, float)):
            writer.add_scalar(key, value, global_step=result["step"])
    writer.flush()


def _progress_columns():
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    return (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn())


def _stats_line(result: dict) -> str:
    parts = [f"reward {result['reward/mean']:.3f}", f"tok/s {result['perf/tokens_per_s']:.0f}"]
    for key, label in (("actor/pg_loss", "pg"), ("critic/vf_loss", "vf"), ("actor/grad_norm", "|g|")):
        if key in result:
            parts.append(f"{label} {result[key]:.3g}")
    return "  ".join(parts)


def print_summary(history: list[dict], eval_rewards: dict[int, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fsdptrain summary")
    table.add_column("what")
    table.add_column("value", justify="right")
    first = history[: min(5, len(history))]
    last = history[-min(5, len(history)):]
    table.add_row("steps", str(len(history)))
    table.add_row("initial policy's mean reward (first step, sampled)", f"{history[0]['reward/mean']:.3f}")
    table.add_row("mean reward, first 5 steps", f"{sum(r['reward/mean'] for r in first) / len(first):.3f}")
    table.add_row("mean reward, last 5 steps", f"{sum(r['reward/mean'] for r in last) / len(last):.3f}")
    if eval_rewards:
        steps = sorted(eval_rewards)
        table.add_row(f"eval reward (greedy) at step {steps[0]}", f"{eval_rewards[steps[0]]:.3f}")
        table.add_row(f"eval reward (greedy) at step {steps[-1]}", f"{eval_rewards[steps[-1]]:.3f}")
    Console(file=sys.stdout).print(table)


class StopRequest:
    """SIGTERM or Ctrl-C asks for a clean stop at the next step boundary; a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            log(f"{signal.Signals(signum).name}: stopping at the next step boundary after a checkpoint "
                "(Ctrl-C again to stop at once, without saving)")
        self.requested = True


def _checkpoint_state(trainer: "Trainer") -> tuple[dict, dict, dict]:
    m = trainer.models
    models = {"policy": m.policy}
    optimizers = {"policy": m.policy_optimizer}
    schedulers = {"policy": m.policy_scheduler}
    if m.critic is not None:
        models["critic"], optimizers["critic"], schedulers["critic"] = m.critic, m.critic_optimizer, m.critic_scheduler
    return models, optimizers, schedulers


def save(trainer: "Trainer", run_dir: Path, done: int) -> Path:
    """A checkpoint after ``done`` steps (collective): models, optimizers, schedulers, counters; RNG per rank."""
    models, optimizers, schedulers = _checkpoint_state(trainer)
    extra = {
        "step": done,
        "data_position": done * trainer.cfg.rollout.prompts_per_step,  # prompt groups consumed
        "nonfinite": {"policy": [trainer.policy_guard.num_skipped, trainer.policy_guard.num_in_a_row],
                      "critic": [trainer.critic_guard.num_skipped, trainer.critic_guard.num_in_a_row]},
        "grad_norm_watch": [trainer.policy_watch.in_a_row, trainer.critic_watch.in_a_row],
    }
    return save_checkpoint(run_dir, done, models=models, optimizers=optimizers, schedulers=schedulers, extra=extra,
                           keep=trainer.cfg.checkpoint.keep)


def resume(trainer: "Trainer", run_dir: Path) -> int:
    """With ``trainer.resume=auto``, restore the newest complete checkpoint of the run; return the steps done."""
    if trainer.cfg.trainer.resume != "auto":
        return 0
    path = latest_checkpoint(run_dir)
    if path is None:
        log(f"trainer.resume=auto: no complete checkpoint in {run_dir}; starting fresh")
        return 0
    models, optimizers, schedulers = _checkpoint_state(trainer)
    extra = load_checkpoint(path, models=models, optimizers=optimizers, schedulers=schedulers)
    per_step = trainer.cfg.rollout.prompts_per_step
    if extra["data_position"] != extra["step"] * per_step:
        raise ConfigError(
            f"{path} consumed {extra['data_position']} prompt groups in {extra['step']} steps, which "
            f"rollout.prompts_per_step={per_step} does not give: resume with the run's own rollout.prompts_per_step")
    if extra["step"] > trainer.cfg.trainer.steps:
        raise ConfigError(f"{path} is after step {extra['step']} but trainer.steps={trainer.cfg.trainer.steps}: "
                          f"raise trainer.steps to continue this run")
    trainer.policy_guard.num_skipped, trainer.policy_guard.num_in_a_row = extra["nonfinite"]["policy"]
    trainer.critic_guard.num_skipped, trainer.critic_guard.num_in_a_row = extra["nonfinite"]["critic"]
    trainer.policy_watch.in_a_row, trainer.critic_watch.in_a_row = extra["grad_norm_watch"]
    log(f"resumed from {path} after step {extra['step']}")
    return int(extra["step"])


def _keep_metrics_before(path: Path, step: int) -> None:
    """Drop logged steps at or after ``step`` (they are about to be redone after a resume)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in lines))


def export(trainer: "Trainer", run_dir: Path) -> None:
    """The final policy (and critic) as Hugging Face folders with safetensors and the tokenizer (collective)."""
    export_hf(trainer.models.policy, run_dir / "export" / "policy", tokenizer=trainer.tokenizer)
    if trainer.models.critic is not None:
        export_hf(trainer.models.critic, run_dir / "export" / "critic", tokenizer=trainer.tokenizer)


def quiet_known_warnings() -> None:
    """FSDP2 warns once that the root returned a view of its output (we take ``logits[0, :, 0]`` and the hidden
    states); we never modify those views in place, which is the case the warning is about."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


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
        _keep_metrics_before(metrics_path, start)
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

    with Progress(*_progress_columns(), disable=not show, transient=False) as progress:
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
            progress.update(task, advance=1, stats=_stats_line(result))
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
