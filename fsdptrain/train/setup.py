"""Building one run from its config: the tokenizer, the sharded models, the trained parts (each model that trains
with its optimizer, schedule, guard, watch and loss: fsdptrain/train/trained_part.py), the loss settings, the dtypes
by config name.

Every rank runs these collectively, in the same order (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from omegaconf import DictConfig

from fsdptrain.config import ConfigError
from fsdptrain.config.distill_rules import distilling
from fsdptrain.config.validate import share_prompts_off_reason
from fsdptrain.distributed.fsdp import adapters_disabled, build_policy, build_reference_model, build_value_model
from fsdptrain.distributed.fsdp_reward_models import build_reward_model, build_value_model_from_reward_model
from fsdptrain.model.attention_backends import shared_prompts_blocker
from fsdptrain.model.attention_switch import resolve_backend, set_attention
from fsdptrain.model.loading import DTYPES, model_source, value_head_names
from fsdptrain.model.lora import lora_settings
from fsdptrain.model.moe import moe_layers
from fsdptrain.model.reward_model import RewardModelSpec, load_reward_model_spec
from fsdptrain.rl.pg_terms import PolicyLossSettings, resolve_policy_loss
from fsdptrain.run.console import log
from fsdptrain.train.optim import GradNormWatch, NonFiniteGuard, build_optimizer, build_scheduler
from fsdptrain.train.pack_losses import packed_policy_loss, packed_value_loss
from fsdptrain.train.step import LossFn
from fsdptrain.train.trained_part import TrainedPart
from fsdptrain.rl.fused_loss import ValueLossSettings



def max_response_length(cfg: DictConfig) -> int:
    return cfg.rollout.max_new_tokens


def loss_scale_factor(cfg: DictConfig) -> float:
    """The -norm constant: configured, else the configured maximum response length (never a packed row length)."""
    return float(cfg.loss.loss_scale_factor) if cfg.loss.loss_scale_factor is not None else float(
        max_response_length(cfg))


def needs_reference(cfg: DictConfig) -> bool:
    return cfg.algorithm.use_kl_loss or cfg.algorithm.kl_in_reward_coef > 0


@dataclass(frozen=True)
class ReferencePolicy:
    """Where the reference log-probs come from (docs/architecture.md, "The reference policy is an interface"): a
    frozen sharded copy of the initial policy (full fine-tuning), or, under LoRA, the policy itself with its adapters
    disabled for the forward, so the reference costs no parameter memory (docs/lora.md)."""

    model: torch.nn.Module
    adapters_off: bool = False

    def forward_context(self):
        """The context the reference's forwards run in (no-grad forwards only)."""
        return adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext()


@dataclass
class Models:
    """The run's models: the trained parts (the policy's, and the critic's with ``algorithm.use_critic``) and the
    frozen ones, with what the rollouts and the experience pass need to know of them."""

    policy_part: TrainedPart
    critic_part: Optional[TrainedPart] = None
    reference: Optional[ReferencePolicy] = None
    backend: str = "sdpa_segments"
    share_prompts: bool = False
    """``trainer.share_prompts`` resolved (auto: on where the backend, the model and the features allow)."""
    share_prompts_why: str = ""
    """Why, for the start report."""
    reward_specs: list[RewardModelSpec] = field(default_factory=list)
    """The checked folders of ``reward.models``, in order (tokenizers for re-tokenising the text)."""
    reward_models: list[torch.nn.Module] = field(default_factory=list)
    """The frozen sharded reward models, one per spec, on the packed attention backend."""
    teacher: Optional[torch.nn.Module] = None
    """On-policy distillation's frozen sharded teacher (``algorithm.distill.teacher``), built like the reference;
    a separate model under LoRA too."""

    @property
    def trained(self) -> list[TrainedPart]:
        """The parts the update trains, in its order: the policy's, then the critic's."""
        return [self.policy_part] + ([] if self.critic_part is None else [self.critic_part])

    @property
    def policy(self) -> torch.nn.Module:
        """The sharded policy (what generates, and what the experience pass scores)."""
        return self.policy_part.model

    @property
    def critic(self) -> Optional[torch.nn.Module]:
        """The sharded value model, or None without a critic."""
        return None if self.critic_part is None else self.critic_part.model


def resolve_share_prompts(cfg: DictConfig, backend: str, model_config) -> tuple[bool, str]:
    """``trainer.share_prompts`` as a bool, and why: true and false as set; auto on unless the config, the resolved
    packed attention ``backend`` or the policy's attention rules it out (docs/packing.md, "Shared prompts")."""
    setting = str(cfg.trainer.share_prompts).lower()  # a bool merged in by code reads as 'True'
    if setting != "auto":
        return setting == "true", f"trainer.share_prompts={setting}"
    why = share_prompts_off_reason(cfg, backend) or shared_prompts_blocker(model_config)
    return why is None, "auto: " + (why or "the backend, the model and the features in use allow it")


def parallel_settings(cfg: DictConfig, mesh) -> dict:
    """How every model of the run is sharded, in which dtypes, compiled or not (``parallel.*``)."""
    return dict(mesh=mesh, param_dtype=DTYPES[cfg.parallel.param_dtype],
                reduce_dtype=DTYPES[cfg.parallel.reduce_dtype],
                reshard_after_forward=cfg.parallel.reshard_after_forward,
                cpu_offload=cfg.parallel.cpu_offload, compile=cfg.parallel.compile,
                compile_backend=cfg.parallel.compile_backend)


def build_policy_model(cfg: DictConfig, tokenizer, mesh, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The policy both recipes train (``fsdptrain train`` and ``fsdptrain sft``): sharded over ``mesh`` (LoRA
    adapters with ``model.lora``; its experts split over ``parallel.ep`` ranks), on the packed attention backend.
    Returns ``(policy, backend)``."""
    policy = build_policy(**model_source(cfg, tokenizer), **parallel_settings(cfg, mesh), seed=cfg.trainer.seed,
                          activation_checkpointing=cfg.parallel.activation_checkpointing, lora=lora_settings(cfg),
                          ep=cfg.parallel.ep)
    if cfg.model.moe.routing_replay and not moe_layers(policy):
        raise ConfigError(f"model.moe.routing_replay=true needs a mixture-of-experts policy; {type(policy).__name__} "
                          "has no router (docs/moe.md): set model.moe.routing_replay=false")
    backend = resolve_backend(cfg.model.attn_backend, device, DTYPES[cfg.parallel.param_dtype])
    set_attention(policy, backend)
    if moe_layers(policy):
        log(moe_line(cfg, policy))
    return policy, backend


def moe_line(cfg: DictConfig, policy: torch.nn.Module) -> str:
    """The start report's line about an MoE policy: its sparse layers, and the load-balancing loss it trains."""
    layers = moe_layers(policy)
    coef = moe_aux_coef(cfg, policy)
    source = ("model.moe.aux_loss_coef" if cfg.model.moe.aux_loss_coef is not None
              else "the model's router_aux_loss_coef")
    loss = (f"load-balancing loss x {coef:g} ({source}) over each mini-batch's tokens" if coef > 0 else
            "no load-balancing loss (coef 0), expert-load metrics only")
    return (f"mixture of experts: {len(layers)} MoE layers of {layers[0].num_experts} experts, top-{layers[0].top_k}; "
            f"{loss} (docs/moe.md)")


def moe_aux_coef(cfg: DictConfig, model: torch.nn.Module) -> Optional[float]:
    """The policy's load-balancing loss weight (docs/moe.md): ``model.moe.aux_loss_coef``, or when null the model
    config's ``router_aux_loss_coef`` (0 when it names none); None for a dense model (no MoE layer)."""
    if not moe_layers(model):
        return None
    if cfg.model.moe.aux_loss_coef is not None:
        return float(cfg.model.moe.aux_loss_coef)
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)


def build_part(cfg: DictConfig, model: torch.nn.Module, *, name: str, prefix: str, lr: float, grad_clip: float,
               loss_fn: LossFn, settings, num_steps: int, moe_coef: Optional[float] = None) -> TrainedPart:
    """``model`` as a trained part: AdamW at ``lr`` over its trainable parameters (betas, epsilon and weight decay
    from ``trainer.*``, shared by every part), the learning-rate schedule of ``trainer.*`` over ``num_steps``, a
    non-finite guard (``trainer.max_nonfinite_in_a_row``) and a grad-norm watch (``trainer.grad_norm_warn_factor``
    x ``grad_clip``)."""
    t = cfg.trainer
    optimizer = build_optimizer(model, lr=lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                weight_decay=t.weight_decay)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, total_steps=num_steps,
                                schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio)
    return TrainedPart(name=name, prefix=prefix, model=model, optimizer=optimizer, scheduler=scheduler,
                       guard=NonFiniteGuard(t.max_nonfinite_in_a_row),
                       watch=GradNormWatch(t.grad_norm_warn_factor, grad_clip, name),
                       loss_fn=loss_fn, settings=settings, grad_clip=grad_clip, moe_coef=moe_coef)


def build_models(cfg: DictConfig, tokenizer, mesh, device: torch.device, *, num_steps: int) -> Models:
    """The policy's part and, with ``algorithm.use_critic``, the critic's (their schedules span ``num_steps``); the
    reference, the teacher and the reward models; all sharded over ``mesh``, on the packed attention backend."""
    source, parallel = model_source(cfg, tokenizer), parallel_settings(cfg, mesh)
    seed = cfg.trainer.seed
    lora = lora_settings(cfg)
    policy, backend = build_policy_model(cfg, tokenizer, mesh, device)
    share, why = resolve_share_prompts(cfg, backend, policy.config)
    models = Models(policy_part=build_part(cfg, policy, name="policy", prefix="actor/", lr=cfg.trainer.lr,
                                           grad_clip=cfg.trainer.grad_clip, loss_fn=packed_policy_loss,
                                           settings=policy_settings(cfg), num_steps=num_steps,
                                           moe_coef=moe_aux_coef(cfg, policy)),
                    backend=backend, share_prompts=share, share_prompts_why=why)
    models.reward_specs = [load_reward_model_spec(path) for path in cfg.reward.models]
    if cfg.algorithm.use_critic:
        critic = _build_critic(cfg, source, parallel, tokenizer, models.reward_specs)
        log(critic_head_line(cfg, critic, from_path=source["path"]))
        set_attention(critic, backend)
        models.critic_part = build_part(cfg, critic, name="critic", prefix="critic/", lr=cfg.trainer.critic_lr,
                                        grad_clip=cfg.trainer.critic_grad_clip, loss_fn=packed_value_loss,
                                        settings=value_settings(cfg), num_steps=num_steps)
    if needs_reference(cfg) and lora is not None:  # the policy without its adapters: no second copy
        models.reference = ReferencePolicy(policy, adapters_off=True)
    elif needs_reference(cfg):
        reference = build_reference_model(**source, **parallel, seed=seed)
        set_attention(reference, backend)
        models.reference = ReferencePolicy(reference)
    if distilling(cfg):
        models.teacher = build_reference_model(path=cfg.algorithm.distill.teacher, config=None, **parallel, seed=seed)
        set_attention(models.teacher, backend)
    models.reward_models = build_reward_models(cfg, models.reward_specs, mesh, backend)
    return models


def build_reward_models(cfg: DictConfig, specs: list[RewardModelSpec], mesh, backend: str) -> list[torch.nn.Module]:
    """The frozen sharded reward models of ``specs`` (``reward.models``), on the packed attention ``backend``."""
    out = []
    for spec in specs:
        reward_model = build_reward_model(spec, mesh=mesh, param_dtype=DTYPES[cfg.parallel.param_dtype],
                                          reshard_after_forward=cfg.parallel.reshard_after_forward,
                                          offload=cfg.reward.model_offload)
        set_attention(reward_model, backend)
        out.append(reward_model)
    return out


@dataclass
class SamplingModels:
    """What sampling and scoring read (a `fsdptrain.rollout.rollout_models.RolloutModels`): the policy and the
    reward models, and nothing that trains (no critic, reference, teacher or optimizer): ``fsdptrain check-reward``'s."""

    policy: torch.nn.Module
    reward_specs: list[RewardModelSpec]
    reward_models: list[torch.nn.Module]


def build_sampling_models(cfg: DictConfig, tokenizer, mesh, device: torch.device) -> SamplingModels:
    """The policy as ``fsdptrain train`` builds it (sharded, on the packed backend) and the reward models."""
    policy, backend = build_policy_model(cfg, tokenizer, mesh, device)
    specs = [load_reward_model_spec(path) for path in cfg.reward.models]
    return SamplingModels(policy=policy, reward_specs=specs, reward_models=build_reward_models(cfg, specs, mesh,
                                                                                              backend))


def _build_critic(cfg: DictConfig, source: dict, parallel: dict, tokenizer, reward_specs: list) -> torch.nn.Module:
    """The value model, its backbone from ``model.value_init``: the policy's, a fresh one, or the first reward
    model's (backbone and head)."""
    checkpointing = cfg.parallel.activation_checkpointing
    if cfg.model.value_init == "reward_model":
        return build_value_model_from_reward_model(reward_specs[0], policy_tokenizer=tokenizer, **source, **parallel,
                                                   activation_checkpointing=checkpointing)
    backbone = {}
    if cfg.model.value_init == "policy":
        backbone = (dict(backbone_from_path=source["path"]) if source["path"] else
                    dict(backbone_from_config=source["config"], backbone_seed=cfg.trainer.seed))
    return build_value_model(**source, **parallel, seed=critic_seed(cfg), activation_checkpointing=checkpointing,
                             lora=lora_settings(cfg, critic=True), **backbone)


def critic_seed(cfg: DictConfig) -> int:
    """The seed the critic's new weights (its value head, a fresh backbone) are drawn from."""
    return cfg.trainer.seed + 1


def critic_head_line(cfg: DictConfig, critic: torch.nn.Module, *, from_path: Optional[str]) -> str:
    """One line on where the critic's value head and backbone come from: the head is new, drawn on purpose (a causal
    LM has none), unless it is the reward model's (``model.value_init=reward_model``)."""
    if cfg.model.value_init == "reward_model":
        return f"critic: value head and backbone from the reward model {cfg.reward.models[0]} (model.value_init)"
    if from_path is not None:
        backbone = f"loaded from {from_path}"
    else:
        backbone = "the policy's initial weights" if cfg.model.value_init == "policy" else "drawn at random"
    heads = ", ".join(value_head_names(critic))
    return (f"critic: value head {heads} ({critic.config.hidden_size} -> 1) drawn at random from seed "
            f"{critic_seed(cfg)}, on purpose (a causal LM has none); backbone {backbone}")


def policy_settings(cfg: DictConfig) -> PolicyLossSettings:
    alg = cfg.algorithm
    return PolicyLossSettings(
        agg_mode=cfg.loss.agg_mode, clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high,
        clip_ratio_c=alg.clip_ratio_c, seq_level_ratio=alg.seq_level_ratio, kl_coef=alg.kl_loss_coef,
        kl_estimator=alg.kl_estimator, entropy_coef=alg.entropy_coef, temperature=cfg.rollout.temperature,
        chunk_size=cfg.loss.logprob_chunk_size, use_reference=bool(alg.use_kl_loss), kl_clamp=alg.kl_clamp,
        pg_loss_fn=resolve_policy_loss(alg.policy_loss), policy_loss=alg.policy_loss, dro_beta=alg.dro_beta,
        use_is_weights=alg.rollout_correction != "none", generation_gap=skips_old_passes(cfg),
        routing_replay=cfg.model.moe.routing_replay,
    )


def value_settings(cfg: DictConfig) -> ValueLossSettings:
    return ValueLossSettings(agg_mode=cfg.loss.agg_mode, cliprange_value=cfg.algorithm.cliprange_value)


def resolve_device_type(cfg: DictConfig) -> str:
    if cfg.trainer.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.trainer.device


def skips_old_passes(cfg: DictConfig) -> bool:
    """Whether the old log-prob pass (and the critic's old-value pass when GAE does not need the values) can be
    skipped exactly: one epoch of one mini-batch, so the first update forward sees the weights that generated the
    experience; no behaviour log-probs from data; no KL-in-reward and no distillation (both read the old log-probs before
    the update); and
    no rollout correction or rejection: their ratios exp(old - behaviour) need the old log-probs before the update; and
    no staleness (``rollout.max_staleness`` > 0 generates with older weights: docs/async.md). On-policy the
    behaviour log-probs are the old ones, so the kept pass gives weights of exactly 1 (exp(0)) and the logged
    ``experience/rollout_is_*`` (docs/off-policy.md)."""
    return (cfg.algorithm.recompute_old_logprobs == "auto" and cfg.algorithm.ppo_epochs == 1
            and cfg.trainer.mini_batches_per_step == 1 and cfg.data.source != "jsonl"
            and cfg.algorithm.kl_in_reward_coef == 0 and not distilling(cfg) and cfg.algorithm.rollout_correction == "none"
            and cfg.algorithm.rollout_rejection == "none" and cfg.algorithm.rollout_rejection_divergence == "none"
            and (cfg.rollout.placement == "colocated" or cfg.rollout.max_staleness == 0))
