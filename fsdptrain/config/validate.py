"""The one validation pass over a composed config: choices, ranges and the rules that span fields.

Runs in the CLI's parent process right after composition (torch-free), so a mistake is one line and exit 2 before
any rank starts.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config.schema import (
    ALGORITHM_NAMES,
    ATTN_BACKENDS,
    DATA_SOURCES,
    DEVICES,
    DRAFT_ON,
    DTYPES,
    LR_SCHEDULES,
    MODEL_ARCHS,
    RESUME_MODES,
    TASKS,
    VALUE_INITS,
)
from fsdptrain.rl.names import (
    ADV_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
)


class ConfigError(ValueError):
    """A user's configuration mistake: the CLI prints its one-line message and exits 2."""


_CHOICES: dict[str, tuple[str, ...]] = {
    "model.arch": MODEL_ARCHS,
    "model.attn_backend": ATTN_BACKENDS,
    "model.value_init": VALUE_INITS,
    "algorithm.name": ALGORITHM_NAMES,
    "algorithm.kl_estimator": KL_ESTIMATORS,
    "algorithm.rollout_correction": ("none", *ROLLOUT_CORRECTION_MODES),
    "algorithm.rollout_correction_level": ROLLOUT_CORRECTION_LEVELS,
    "loss.agg_mode": AGG_MODES,
    "data.source": DATA_SOURCES,
    "data.task": TASKS,
    "trainer.lr_schedule": LR_SCHEDULES,
    "trainer.resume": RESUME_MODES,
    "trainer.device": DEVICES,
    "parallel.param_dtype": DTYPES,
    "parallel.reduce_dtype": DTYPES,
    "drafter.on": DRAFT_ON,
    "drafter.export_dtype": DTYPES,
}

_POSITIVE_INTS = (
    "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.intermediate_size",
    "algorithm.ppo_epochs", "loss.logprob_chunk_size", "rollout.prompts_per_step", "rollout.n",
    "rollout.max_new_tokens", "trainer.steps", "trainer.mini_batches_per_step", "trainer.token_budget",
    "trainer.max_nonfinite_in_a_row", "parallel.dp_replicate", "checkpoint.keep", "check.simulated_dp",
    "check.num_prompts", "algorithm.filter_groups_max_rounds", "drafter.vocab_from_steps",
)
_NON_NEGATIVE = (
    "trainer.warmup_steps", "trainer.weight_decay", "trainer.grad_clip", "trainer.critic_grad_clip",
    "trainer.eval_every", "checkpoint.every", "algorithm.entropy_coef", "algorithm.kl_loss_coef",
    "algorithm.kl_in_reward_coef", "algorithm.cliprange_value", "algorithm.clip_ratio_low",
    "algorithm.clip_ratio_high", "data.num_eval_prompts", "check.rtol", "check.atol",
    "drafter.loss_weight", "drafter.weight_decay", "drafter.grad_clip",
)
_POSITIVE_FLOATS = (
    "trainer.lr", "trainer.critic_lr", "rollout.temperature", "trainer.grad_norm_warn_factor", "trainer.adam_eps",
    "algorithm.dro_beta", "algorithm.rollout_correction_cap", "drafter.lr",
)


def _get(cfg: DictConfig, dotted: str) -> Any:
    return OmegaConf.select(cfg, dotted, throw_on_missing=True)


_PLUGGABLE: dict[str, tuple[str, ...]] = {
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.policy_loss": POLICY_LOSSES,
}
"""Fields that take a built-in name or a user's function (`module:function` / `path.py:function`, loaded and its
signature checked by the CLI, `fsdptrain/plugins.py`)."""


def _check_choices(cfg: DictConfig) -> None:
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not a valid choice; choose one of: {', '.join(choices)}")
    for key, choices in _PLUGGABLE.items():
        value = _get(cfg, key)
        if value not in choices and ":" not in str(value):
            raise ConfigError(f"{key}={value!r} is not a valid choice; choose one of: {', '.join(choices)}, "
                              "or a function as module:function or path/to/file.py:function")


def _check_ranges(cfg: DictConfig) -> None:
    for key in _POSITIVE_INTS:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be a positive integer")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")
    for key in _POSITIVE_FLOATS:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")
    top_p = cfg.rollout.top_p
    if not 0 < top_p <= 1:
        raise ConfigError(f"rollout.top_p={top_p} must be in (0, 1]")
    for key in ("trainer.adam_beta1", "trainer.adam_beta2"):
        if not 0 <= _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be in [0, 1)")
    if not 0 <= cfg.trainer.min_lr_ratio <= 1:
        raise ConfigError(f"trainer.min_lr_ratio={cfg.trainer.min_lr_ratio} must be in [0, 1]")
    dp_shard = cfg.parallel.dp_shard
    if dp_shard != "auto" and not (str(dp_shard).isdigit() and int(dp_shard) >= 1):
        raise ConfigError(f"parallel.dp_shard={dp_shard!r} must be 'auto' or a positive integer")


def _check_cross_fields(cfg: DictConfig) -> None:
    alg = cfg.algorithm
    if alg.adv_estimator == "gae" and not alg.use_critic:
        raise ConfigError("algorithm.adv_estimator=gae needs a value model: set algorithm.use_critic=true "
                          "or choose algorithm.adv_estimator=grpo or rloo")
    kl_clamp = alg.kl_clamp
    if kl_clamp is not None and not kl_clamp > 0:
        raise ConfigError(f"algorithm.kl_clamp={kl_clamp} must be > 0 (or null for no clamp)")
    if alg.filter_groups and cfg.data.source != "task":
        raise ConfigError("algorithm.filter_groups=true needs data.source=task (it generates more prompts): "
                          "set algorithm.filter_groups=false for offline rollouts")
    if alg.filter_groups and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.filter_groups=true compares samples of one prompt: rollout.n={cfg.rollout.n} "
                          "must be at least 2")
    if alg.seq_level_ratio and alg.policy_loss != "vanilla":
        raise ConfigError(f"algorithm.seq_level_ratio=true (GSPO) needs algorithm.policy_loss=vanilla, "
                          f"got {alg.policy_loss!r}")
    group_estimators = ("grpo", "rloo", "reinforce_plus_plus_baseline")
    if alg.adv_estimator in group_estimators and cfg.data.source == "task" and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} compares samples of one prompt: "
                          f"rollout.n={cfg.rollout.n} must be at least 2")
    if alg.clip_ratio_c is not None and alg.clip_ratio_c <= 1:
        raise ConfigError(f"algorithm.clip_ratio_c={alg.clip_ratio_c} must be > 1 (or null to turn dual-clip off)")
    if cfg.model.num_heads % cfg.model.num_kv_heads != 0:
        raise ConfigError(f"model.num_kv_heads={cfg.model.num_kv_heads} must divide "
                          f"model.num_heads={cfg.model.num_heads}")
    if cfg.model.hidden_size % cfg.model.num_heads != 0:
        raise ConfigError(f"model.num_heads={cfg.model.num_heads} must divide "
                          f"model.hidden_size={cfg.model.hidden_size}")
    factor = cfg.loss.loss_scale_factor
    if factor is not None and not factor > 0:
        raise ConfigError(f"loss.loss_scale_factor={factor} must be > 0 (or null for the max response length)")
    if cfg.data.source == "jsonl":
        if cfg.data.path is None:
            raise ConfigError("data.source=jsonl needs data.path=<file.jsonl>")
        if cfg.data.max_response_length is None or cfg.data.max_response_length < 1:
            raise ConfigError("data.source=jsonl needs data.max_response_length=<declared maximum response tokens>")
    if cfg.rollout.prompts_per_step % cfg.trainer.mini_batches_per_step != 0:
        raise ConfigError(f"trainer.mini_batches_per_step={cfg.trainer.mini_batches_per_step} must divide "
                          f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}")


def _check_drafter(cfg: DictConfig) -> None:
    drafter = cfg.drafter
    layers = drafter.feature_layers
    if layers is not None and (len(layers) != 3 or any(i < 0 for i in layers)):
        raise ConfigError(f"drafter.feature_layers={list(layers)} must name 3 policy layers (indices >= 0), "
                          "or be null for vLLM's default")
    size = drafter.draft_vocab_size
    if size is not None and size < 1:
        raise ConfigError(f"drafter.draft_vocab_size={size} must be a positive integer (or null)")
    if drafter.enabled and drafter.vocab_path is None and drafter.vocab_from_steps > cfg.trainer.steps:
        raise ConfigError(f"drafter.vocab_from_steps={drafter.vocab_from_steps} must be at most "
                          f"trainer.steps={cfg.trainer.steps} (the drafter trains after its vocabulary is counted)")


def validate(cfg: DictConfig) -> None:
    """Check every choice, range and cross-field rule of a composed config; raise :class:`ConfigError` on the first."""
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_cross_fields(cfg)
    _check_drafter(cfg)


def validate_mesh_shape(world_size: int, dp_replicate: int, dp_shard: int | None) -> tuple[int, int]:
    """Check a (dp_replicate, dp_shard) layout against the world size and return it with `dp_shard` resolved.

    `dp_shard=None` means auto: world_size / dp_replicate. Pure (no process group, no torch), so the CLI rejects a
    bad layout in the parent before any rank starts; `fsdptrain.distributed.world.build_mesh` applies the same rule.
    Raises ConfigError (a ValueError) with the fix in the message.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    if not isinstance(dp_replicate, int) or dp_replicate < 1:
        raise ConfigError(f"parallel.dp_replicate must be a positive integer, got {dp_replicate!r}")
    if dp_shard is None:
        if world_size % dp_replicate != 0:
            raise ConfigError(
                f"parallel.dp_replicate={dp_replicate} does not divide the world size {world_size}: "
                f"choose a dp_replicate that divides {world_size}, or change the number of processes"
            )
        return dp_replicate, world_size // dp_replicate
    if not isinstance(dp_shard, int) or dp_shard < 1:
        raise ConfigError(f"parallel.dp_shard must be a positive integer or auto, got {dp_shard!r}")
    if dp_replicate * dp_shard != world_size:
        raise ConfigError(
            f"parallel.dp_replicate x parallel.dp_shard = {dp_replicate} x {dp_shard} = {dp_replicate * dp_shard} "
            f"but the world size is {world_size}: set parallel.dp_shard=auto (world size / dp_replicate) "
            f"or launch {dp_replicate * dp_shard} processes"
        )
    return dp_replicate, dp_shard


def validate_world(cfg: DictConfig, world_size: int) -> tuple[int, int]:
    """The mesh shape ``(dp_replicate, dp_shard)`` for ``world_size`` processes, or a ConfigError naming the mismatch.

    Every rank also needs at least one prompt group to generate for (generation is collective under FSDP).
    """
    for key in ("rollout.prompts_per_step", "data.num_eval_prompts"):
        if OmegaConf.select(cfg, key) < world_size:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be at least the number of ranks "
                              f"({world_size}): every rank needs a prompt")
    shard = cfg.parallel.dp_shard
    return validate_mesh_shape(world_size, cfg.parallel.dp_replicate, None if shard == "auto" else int(shard))
