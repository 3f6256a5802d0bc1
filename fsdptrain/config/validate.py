"""The one validation pass over a composed config: choices, ranges and the rules that span fields.

Runs in the CLI's parent process right after composition (torch-free), so a mistake is one line and exit 2 before
any rank starts.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config.schema import (
    ALGORITHM_NAMES,
    ATTN_BACKENDS,
    COMPILE_BACKENDS,
    DATA_SOURCES,
    DEVICES,
    DTYPES,
    GATHER_MODES,
    LOGGING_BACKENDS,
    LONG_PROMPTS,
    LR_SCHEDULES,
    MODEL_ARCHS,
    RECOMPUTE_MODES,
    RESUME_MODES,
    REWARD_MODEL_NORMALIZE,
    SCHEMA_GROUPS,
    TASKS,
    VALUE_INITS,
)
from fsdptrain.registry.errors import ConfigError
from fsdptrain.registry.names import (
    ADV_ESTIMATORS,
    AGG_MODES,
    DRAFT_ON,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
)

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
    "data.long_prompts": LONG_PROMPTS,
    "trainer.lr_schedule": LR_SCHEDULES,
    "trainer.resume": RESUME_MODES,
    "trainer.device": DEVICES,
    "parallel.param_dtype": DTYPES,
    "parallel.reduce_dtype": DTYPES,
    "parallel.compile_backend": COMPILE_BACKENDS,
    "rollout.gather_weights": GATHER_MODES,
    "algorithm.recompute_old_logprobs": RECOMPUTE_MODES,
    "reward.model_normalize": REWARD_MODEL_NORMALIZE,
    "drafter.on": DRAFT_ON,
    "drafter.export_dtype": DTYPES,
}

_POSITIVE_INTS = (
    "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.intermediate_size",
    "algorithm.ppo_epochs", "loss.logprob_chunk_size", "rollout.prompts_per_step", "rollout.n",
    "rollout.max_new_tokens", "trainer.steps", "trainer.mini_batches_per_step", "trainer.token_budget",
    "trainer.max_nonfinite_in_a_row", "parallel.dp_replicate", "checkpoint.keep", "check.simulated_dp",
    "check.num_prompts", "data.max_response_length", "algorithm.filter_groups_max_rounds", "data.num_rows",
    "drafter.vocab_from_steps", "drafter.num_layers",
)
"""Every other int field of the schema must be >= 0 (seeds, counts, intervals): see :func:`_check_ints`."""

_INF = float("inf")
FLOAT_RANGES: dict[str, tuple[float, bool, float, bool]] = {
    # field: (low, low included, high, high included); every float must also be finite (nan and inf are refused)
    "algorithm.gamma": (0.0, True, 1.0, True),
    "algorithm.lam": (0.0, True, 1.0, True),
    "algorithm.clip_ratio_low": (0.0, False, 1.0, True),
    "algorithm.clip_ratio_high": (0.0, False, _INF, False),
    "algorithm.clip_ratio_c": (1.0, False, _INF, False),
    "algorithm.cliprange_value": (0.0, False, _INF, False),
    "algorithm.entropy_coef": (0.0, True, _INF, False),
    "algorithm.kl_loss_coef": (0.0, True, _INF, False),
    "algorithm.kl_in_reward_coef": (0.0, True, _INF, False),
    "loss.loss_scale_factor": (0.0, False, _INF, False),
    "rollout.temperature": (0.0, False, _INF, False),
    "rollout.top_p": (0.0, False, 1.0, True),
    "trainer.lr": (0.0, False, _INF, False),
    "trainer.critic_lr": (0.0, False, _INF, False),
    "trainer.min_lr_ratio": (0.0, True, 1.0, True),
    "trainer.weight_decay": (0.0, True, _INF, False),
    "trainer.grad_clip": (0.0, True, _INF, False),
    "trainer.critic_grad_clip": (0.0, True, _INF, False),
    "trainer.grad_norm_warn_factor": (0.0, False, _INF, False),
    "check.rtol": (0.0, True, _INF, False),
    "check.atol": (0.0, True, _INF, False),
    "trainer.adam_beta1": (0.0, True, 1.0, False),
    "trainer.adam_beta2": (0.0, True, 1.0, False),
    "trainer.adam_eps": (0.0, False, _INF, False),
    "trainer.epochs": (0.0, False, _INF, False),
    "algorithm.dro_beta": (0.0, False, _INF, False),
    "algorithm.kl_clamp": (0.0, False, _INF, False),
    "algorithm.rollout_correction_cap": (0.0, False, _INF, False),
    "reward.timeout_s": (0.0, False, _INF, False),
    "reward.timeout_score": (-_INF, False, _INF, False),
    "rollout.gather_weights_max_share": (0.0, False, 1.0, True),
    "perf.peak_tflops": (0.0, False, _INF, False),
    "drafter.loss_weight": (0.0, True, _INF, False),
    "drafter.lr": (0.0, False, _INF, False),
    "drafter.weight_decay": (0.0, True, _INF, False),
    "drafter.grad_clip": (0.0, True, _INF, False),
    "reward.model_clip": (0.0, False, _INF, False),
}
"""The real range of every float field of the schema (a unit test checks that none is missing)."""


def _get(cfg: DictConfig, dotted: str) -> Any:
    return OmegaConf.select(cfg, dotted, throw_on_missing=True)


_PLUGGABLE: dict[str, tuple[str, ...]] = {
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.policy_loss": POLICY_LOSSES,
}
"""Fields that take a built-in name or a user's function (`module:function` / `path.py:function`, loaded and its
signature checked by the CLI, `fsdptrain/registry/user_functions.py`)."""


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


def schema_fields(kind: type) -> list[str]:
    """The dotted names of every schema field whose type is ``kind`` (int or float), Optional included."""
    names = []
    for group, schema in SCHEMA_GROUPS.items():
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            hint = hints[f.name]
            if hint is kind or (typing.get_origin(hint) is typing.Union and kind in typing.get_args(hint)):
                names.append(f"{group}.{f.name}")
    return names


def _describe_range(low: float, low_in: bool, high: float, high_in: bool) -> str:
    if high == _INF:
        return f"a finite number {'>=' if low_in else '>'} {low:g}"
    return f"a number in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def _check_floats(cfg: DictConfig) -> None:
    for key in schema_fields(float):
        value = _get(cfg, key)
        if value is None:
            continue
        low, low_in, high, high_in = FLOAT_RANGES[key]
        above = value >= low if low_in else value > low
        below = value <= high if high_in else value < high
        if not (math.isfinite(value) and above and below):
            raise ConfigError(f"{key}={value} must be {_describe_range(low, low_in, high, high_in)}")


def _check_ints(cfg: DictConfig) -> None:
    for key in schema_fields(int):
        value = _get(cfg, key)
        if value is None:
            continue
        if key in _POSITIVE_INTS and value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer")
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")


def _check_ranges(cfg: DictConfig) -> None:
    _check_ints(cfg)
    _check_floats(cfg)
    dp_shard = cfg.parallel.dp_shard
    if dp_shard != "auto" and not (str(dp_shard).isdigit() and int(dp_shard) >= 1):
        raise ConfigError(f"parallel.dp_shard={dp_shard!r} must be 'auto' or a positive integer")


DEFAULT_STEPS = 100
"""Training steps when neither trainer.steps nor trainer.epochs is set."""
TASK_REWARD = "word_match"
"""The bundled digit tasks' reward function (reward.functions=null)."""


def reward_specs(cfg: DictConfig) -> list[str]:
    """The configured reward functions: ``reward.functions``; when it is null, none if ``reward.models`` is set,
    else the bundled tasks' reward."""
    functions = cfg.reward.functions
    if functions is None:
        return [] if cfg.reward.models else [TASK_REWARD]
    return list(functions)


def _check_reward_models(cfg: DictConfig) -> None:
    """The reward-model settings that span fields (each folder itself is checked by the CLI's preflight)."""
    r = cfg.reward
    if r.functions is not None and len(r.functions) == 0 and not r.models:
        raise ConfigError("reward.functions is empty and reward.models too: name at least one reward function or "
                          "reward model")
    if r.model_weights is not None:
        if len(r.model_weights) != len(r.models):
            raise ConfigError(f"reward.model_weights has {len(r.model_weights)} weights for {len(r.models)} "
                              f"reward.models")
        for w in r.model_weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ConfigError(f"reward.model_weights: {w!r} is not a finite number")
    if cfg.model.value_init == "reward_model":
        if not r.models:
            raise ConfigError("model.value_init=reward_model needs a reward model: set reward.models=[PATH] or "
                              "choose model.value_init=policy")
        if not cfg.algorithm.use_critic:
            raise ConfigError("model.value_init=reward_model starts the critic, but algorithm.use_critic=false: "
                              "set algorithm.use_critic=true or drop model.value_init")
    if r.models and cfg.data.source == "jsonl":
        raise ConfigError("reward.models scores generated samples: use data=task or data=prompts, not data=jsonl "
                          "(offline rollouts carry their rewards)")


def _check_steps_and_logging(cfg: DictConfig) -> None:
    steps, epochs = cfg.trainer.steps, cfg.trainer.epochs
    if steps is not None and epochs is not None:
        raise ConfigError(f"trainer.steps={steps} and trainer.epochs={epochs} are both set: set one of them")
    if steps is not None and steps < 1:
        raise ConfigError(f"trainer.steps={steps} must be a positive integer")
    if epochs is not None and not epochs > 0:
        raise ConfigError(f"trainer.epochs={epochs} must be > 0")
    if epochs is not None and cfg.data.source == "jsonl":
        raise ConfigError("trainer.epochs needs data=prompts or data=task (offline rollouts cycle): set trainer.steps")
    for backend in cfg.logging.backends:
        if backend not in LOGGING_BACKENDS:
            raise ConfigError(f"logging.backends: {backend!r} is not a valid choice; choose from: "
                              f"{', '.join(LOGGING_BACKENDS)}")
    if cfg.data.source == "prompts":
        if cfg.data.path is None:
            raise ConfigError("data.source=prompts needs data.path=<file or folder of prompts>")
        if cfg.reward.functions is None and not cfg.reward.models:
            raise ConfigError("data.source=prompts needs reward.functions=[...] (built-in names, module:function "
                              "or path.py:function) or reward.models=[...]")
    max_prompt = cfg.data.max_prompt_length
    if max_prompt is not None and max_prompt < 1:
        raise ConfigError(f"data.max_prompt_length={max_prompt} must be a positive integer (or null)")


def _check_cross_fields(cfg: DictConfig) -> None:
    alg = cfg.algorithm
    if alg.adv_estimator == "gae" and not alg.use_critic:
        raise ConfigError("algorithm.adv_estimator=gae needs a value model: set algorithm.use_critic=true "
                          "or choose algorithm.adv_estimator=grpo or rloo")
    kl_clamp = alg.kl_clamp
    if kl_clamp is not None and not kl_clamp > 0:
        raise ConfigError(f"algorithm.kl_clamp={kl_clamp} must be > 0 (or null for no clamp)")
    if alg.filter_groups and cfg.data.source == "jsonl":
        raise ConfigError("algorithm.filter_groups=true generates more prompts, which offline rollouts cannot: "
                          "set algorithm.filter_groups=false for data.source=jsonl")
    if alg.filter_groups and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.filter_groups=true compares samples of one prompt: rollout.n={cfg.rollout.n} "
                          "must be at least 2")
    if alg.seq_level_ratio and alg.policy_loss != "vanilla":
        raise ConfigError(f"algorithm.seq_level_ratio=true (GSPO) needs algorithm.policy_loss=vanilla, "
                          f"got {alg.policy_loss!r}")
    group_estimators = ("grpo", "rloo", "reinforce_plus_plus_baseline")
    if alg.adv_estimator in group_estimators and cfg.data.source != "jsonl" and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} compares samples of one prompt: "
                          f"rollout.n={cfg.rollout.n} must be at least 2")
    if cfg.model.num_heads % cfg.model.num_kv_heads != 0:
        raise ConfigError(f"model.num_kv_heads={cfg.model.num_kv_heads} must divide "
                          f"model.num_heads={cfg.model.num_heads}")
    if cfg.model.hidden_size % cfg.model.num_heads != 0:
        raise ConfigError(f"model.num_heads={cfg.model.num_heads} must divide "
                          f"model.hidden_size={cfg.model.hidden_size}")
    if cfg.data.source == "jsonl":
        if cfg.data.path is None:
            raise ConfigError("data.source=jsonl needs data.path=<file.jsonl>")
        if cfg.data.max_response_length is None:
            raise ConfigError("data.source=jsonl needs data.max_response_length=<declared maximum response tokens>")
    if cfg.trainer.overwrite and cfg.trainer.resume == "auto":
        raise ConfigError("trainer.overwrite=true deletes what trainer.resume=auto would continue: choose one")
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
    if drafter.path is not None and drafter.vocab_path is not None:
        raise ConfigError(f"drafter.path={drafter.path} brings its own vocabulary (d2t/t2d): unset "
                          f"drafter.vocab_path={drafter.vocab_path}")
    steps = cfg.trainer.steps if cfg.trainer.steps is not None else DEFAULT_STEPS  # epochs: checked at the run
    if drafter.enabled and drafter.vocab_path is None and drafter.path is None and drafter.vocab_from_steps > steps:
        raise ConfigError(f"drafter.vocab_from_steps={drafter.vocab_from_steps} must be at most "
                          f"trainer.steps={steps} (the drafter trains after its vocabulary is counted)")


def validate(cfg: DictConfig) -> None:
    """Check every choice, range and cross-field rule of a composed config; raise :class:`ConfigError` on the first."""
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_cross_fields(cfg)
    _check_steps_and_logging(cfg)
    _check_reward_models(cfg)
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
    keys = ["rollout.prompts_per_step"]
    if cfg.data.source == "task":
        keys.append("data.num_eval_prompts")
    elif cfg.data.source == "prompts" and cfg.data.eval_path is None and cfg.data.eval_size > 0:
        keys.append("data.eval_size")
    for key in keys:
        if OmegaConf.select(cfg, key) < world_size:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be at least the number of ranks "
                              f"({world_size}): every rank needs a prompt")
    shard = cfg.parallel.dp_shard
    return validate_mesh_shape(world_size, cfg.parallel.dp_replicate, None if shard == "auto" else int(shard))
