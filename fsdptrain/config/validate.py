"""The one validation pass over a composed config: choices, ranges and the rules that span fields.

Runs in the CLI's parent process right after composition (torch-free), so a mistake is one line and exit 2 before
any rank starts.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config.distill_rules import check_distill
from fsdptrain.config.sft_rules import check_sft
from fsdptrain.config.drafter_rules import check_drafter
from fsdptrain.config.replay_rules import check_routing_replay
from fsdptrain.config.lora_rules import check_lora
from fsdptrain.registry import names
from fsdptrain.registry.errors import ConfigError
from fsdptrain.registry.plugins import import_plugins, registered
from fsdptrain.config.fields import Range, field_choices, field_item_range, field_range, flat_fields
from fsdptrain.config.schema import DEFAULT_STEPS, SCHEMA_GROUPS

__all__ = ["DEFAULT_STEPS", "RENAMED_KEYS", "ConfigError", "declared_range", "renamed_key_message", "reward_specs",
           "schema_fields", "trainer_ranks", "validate", "validate_mesh_shape", "validate_world"]

RENAMED_KEYS = {
    "data.eval_size": "data.num_eval_prompts",
    "data.max_response_length": "rollout.max_new_tokens",
}
"""Keys a release removed, and the key that now holds their value."""


def renamed_key_message(dotted: str) -> str | None:
    """The one-line error for a removed key, naming the key to use instead; None for any other key."""
    new = RENAMED_KEYS.get(dotted)
    return None if new is None else f"{dotted} was renamed: set {new} instead"


def _schema_items():
    for group, schema in SCHEMA_GROUPS.items():
        for dotted, f, hint, _ in flat_fields(schema, group):
            yield dotted, f, hint


def _is(hint: Any, kind: type) -> bool:
    return hint is kind or (typing.get_origin(hint) is typing.Union and kind in typing.get_args(hint))


def schema_fields(kind: type) -> list[str]:
    """The dotted names of every schema field whose type is ``kind`` (int or float), Optional included."""
    return [key for key, _, hint in _schema_items() if _is(hint, kind)]


def declared_range(dotted: str) -> Range | None:
    """The range declared on the schema field ``group.field`` (or ``group.sub.field``; None for a field that is not a
    number)."""
    return field_range({key: f for key, f, _ in _schema_items()}[dotted])


def _choices_message(key: str, value: Any, choices: tuple[str, ...], user_function: bool) -> str:
    valid = ", ".join(choices)
    if user_function:
        return (f"{key}={value!r} is not a valid choice; choose one of: {valid}, "
                "a name registered by algorithm.plugins, or a function as module:function or path/to/file.py:function")
    return f"{key}={value!r} is not a valid choice; choose one of: {valid}"


def _check_choices(cfg: DictConfig) -> None:
    """Every field declared with ``choice``/``each_of``; a user_function field also takes ``module:function`` (loaded
    and its signature checked by the CLI, `fsdptrain/registry/user_functions.py`) or a name registered by one of
    ``algorithm.plugins`` (imported here, `fsdptrain/registry/plugins.py`)."""
    import_plugins(list(cfg.algorithm.plugins))
    for key, f, _ in _schema_items():
        choices = field_choices(f)
        if choices is None:
            continue
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
        if "each_of" in f.metadata:
            for item in value:
                if item not in choices:
                    raise ConfigError(f"{key}: {item!r} is not a valid choice; choose from: {', '.join(choices)}")
            continue
        user_function = f.metadata["user_function"]
        if value not in choices and not (user_function and (":" in str(value) or value in registered(key))):
            raise ConfigError(_choices_message(key, value, choices, user_function))


def _range_message(key: str, value: float, bounds: Range, hint: Any) -> str:
    """The error for a number outside its field's range: floats name the range, ints say positive or >= 0."""
    if _is(hint, float):
        return f"{key}={value} must be {bounds.describe()}"
    if bounds.low == 1:
        return f"{key}={value} must be a positive integer{' (or null)' if _is(hint, type(None)) else ''}"
    return f"{key}={value} must be >= 0"


def _check_ranges(cfg: DictConfig) -> None:
    """Every number against the range its field declares (every int and float field declares one), ints first."""
    items = list(_schema_items())
    for kind in (int, float):
        for key, f, hint in items:
            if not _is(hint, kind):
                continue
            value = OmegaConf.select(cfg, key, throw_on_missing=True)
            bounds = field_range(f)
            assert bounds is not None, f"{key} declares no range in fsdptrain/config/schema.py"
            if value is not None and not bounds.contains(value):
                raise ConfigError(_range_message(key, value, bounds, hint))
    for key, f, _ in items:
        bounds = field_item_range(f)
        if bounds is None:
            continue
        for item in OmegaConf.select(cfg, key, throw_on_missing=True):
            if isinstance(item, bool) or not isinstance(item, int) or not bounds.contains(item):
                raise ConfigError(f"{key}: {item!r} must be an integer >= {bounds.low:g}")
    dp_shard = cfg.parallel.dp_shard
    if dp_shard != "auto" and not (str(dp_shard).isdigit() and int(dp_shard) >= 1):
        raise ConfigError(f"parallel.dp_shard={dp_shard!r} must be 'auto' or a positive integer")


TASK_REWARD = "word_match"
"""The bundled digit tasks' reward function (reward.functions=null)."""


def reward_specs(cfg: DictConfig) -> list[str]:
    """The configured reward functions: ``reward.functions``; when it is null, none if ``reward.models`` or
    ``rollout.agent`` (its return value) is set, else the bundled tasks' reward."""
    functions = cfg.reward.functions
    if functions is None:
        return [] if cfg.reward.models or cfg.rollout.agent is not None else [TASK_REWARD]
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


def multi_turn(cfg: DictConfig) -> bool:
    """Rollouts are multi-turn: ``rollout.tools`` or ``rollout.environment`` is set (docs/multi-turn.md), or the
    user's agent drives them (``rollout.agent``, docs/agents.md)."""
    return bool(cfg.rollout.tools) or cfg.rollout.environment is not None or cfg.rollout.agent is not None


def _check_multi_turn(cfg: DictConfig) -> None:
    r = cfg.rollout
    if r.agent is not None:
        if r.tools or r.environment is not None:
            raise ConfigError("rollout.agent runs the user's agent, which calls its own tools: drop rollout.tools / "
                              "rollout.environment (or drop rollout.agent)")
        if r.engine != "continuous":
            raise ConfigError(f"rollout.agent needs rollout.engine=continuous (its requests arrive while others "
                              f"decode, each row-seeded), not rollout.engine={r.engine}")
        if cfg.data.source == "jsonl":
            raise ConfigError("rollout.agent generates its rollouts: use data=task or data=prompts, not data=jsonl")
    if multi_turn(cfg) and cfg.data.source == "jsonl":
        raise ConfigError("rollout.tools / rollout.environment generate multi-turn rollouts: use data=task or "
                          "data=prompts, not data=jsonl (offline rollouts are read as they are)")
    if cfg.rollout.environment is not None and cfg.reward.num_workers > 0:
        raise ConfigError("rollout.environment needs reward.num_workers=0: its instances (their state, get_reward, "
                          "the environments= of reward functions) live in the training process")


def _check_steps_and_logging(cfg: DictConfig) -> None:
    steps, epochs = cfg.trainer.steps, cfg.trainer.epochs
    if steps is not None and epochs is not None:
        raise ConfigError(f"trainer.steps={steps} and trainer.epochs={epochs} are both set: set one of them")
    if epochs is not None and cfg.data.source == "jsonl":
        raise ConfigError("trainer.epochs needs data=prompts or data=task (offline rollouts cycle): set trainer.steps")
    if cfg.data.source == "prompts":
        if cfg.data.path is None:
            raise ConfigError("data.source=prompts needs data.path=<file or folder of prompts>")
        if cfg.reward.functions is None and not cfg.reward.models and cfg.rollout.agent is None:
            raise ConfigError("data.source=prompts needs reward.functions=[...] (built-in names, module:function "
                              "or path.py:function), reward.models=[...] or rollout.agent (its return value)")


def _check_run_name(name: Any) -> None:
    """``trainer.run_name`` names a folder directly under ``runs/``: no path separators, no ``.``/``..``, not empty
    (a run elsewhere is ``trainer.run_dir``)."""
    if name is None:
        return
    text = str(name)
    if not text.strip() or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise ConfigError(f"trainer.run_name={text!r} must be a plain name (a folder under runs/, without '/', '..' "
                          f"or an absolute path): set trainer.run_dir=PATH to write the run elsewhere")


def _check_cross_fields(cfg: DictConfig) -> None:
    alg = cfg.algorithm
    if cfg.trainer.share_prompts == "true" and cfg.model.attn_backend == "torch_varlen":
        raise ConfigError("trainer.share_prompts=true needs keys apart from queries, which model.attn_backend="
                          "torch_varlen does not take: choose auto, flash_attn or sdpa_segments")
    if alg.adv_estimator == "gae" and not alg.use_critic:
        raise ConfigError("algorithm.adv_estimator=gae needs a value model: set algorithm.use_critic=true "
                          "or choose algorithm.adv_estimator=grpo or rloo")
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
    if cfg.data.source == "jsonl" and cfg.data.path is None:
        raise ConfigError("data.source=jsonl needs data.path=<file.jsonl>")
    _check_run_name(cfg.trainer.run_name)
    if cfg.trainer.overwrite and cfg.trainer.resume == "auto":
        raise ConfigError("trainer.overwrite=true deletes what trainer.resume=auto would continue: choose one")
    eval_n = cfg.trainer.eval_n
    too_big = [k for k in cfg.trainer.eval_k if k > eval_n]
    if too_big:
        raise ConfigError(f"trainer.eval_k: pass@{too_big[0]} needs at least {too_big[0]} samples per prompt, but "
                          f"trainer.eval_n={eval_n}: each k must be in [1, eval_n]")
    _check_context_parallel(cfg)
    _check_expert_parallel(cfg)
    _check_placement(cfg)
    if cfg.data.source != "sft" and cfg.rollout.prompts_per_step % cfg.trainer.mini_batches_per_step != 0:
        raise ConfigError(f"trainer.mini_batches_per_step={cfg.trainer.mini_batches_per_step} must divide "
                          f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}")


def _check_placement(cfg: DictConfig) -> None:
    """rollout.placement=separate's settings apply to it only, and it generates what it can hand over whole: no
    offline rollouts, no environment objects (they live with the rewards, on the trainer ranks), no extra rounds of
    dynamic sampling, no drafter trained on the generating forward (docs/async.md)."""
    r = cfg.rollout
    if r.placement == "colocated":
        for key, default in (("max_staleness", 0), ("generator_ranks", 1)):
            if r[key] != default:
                raise ConfigError(f"rollout.{key}={r[key]} applies to rollout.placement=separate only: set "
                                  f"rollout.placement=separate or leave rollout.{key} out")
        return
    refusals = [(cfg.data.source == "jsonl", "data.source=jsonl (offline rollouts are not generated)"),
                (r.environment is not None, "rollout.environment (its objects score on the trainer ranks)"),
                (r.agent is not None, "rollout.agent (its endpoint serves the colocated rollouts)"),
                (cfg.algorithm.filter_groups, "algorithm.filter_groups=true (extra rounds of generation)"),
                (cfg.drafter.enabled, "drafter.enabled=true (it trains on the generating forward)")]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"rollout.placement=separate does not run with {what}: use rollout.placement=colocated "
                              "(docs/async.md)")


def trainer_ranks(cfg: DictConfig, world_size: int) -> int:
    """The ranks that train out of ``world_size`` launched: all of them colocated, all but the last
    ``rollout.generator_ranks`` with ``rollout.placement=separate`` (ConfigError when none would be left)."""
    if cfg.data.source == "sft" or cfg.rollout.placement == "colocated":
        return world_size
    generators = cfg.rollout.generator_ranks
    if generators >= world_size:
        raise ConfigError(f"rollout.generator_ranks={generators} leaves no trainer rank among the {world_size} "
                          f"launched: launch more ranks (--nproc) or lower rollout.generator_ranks")
    return world_size - generators


CP_BACKENDS = ("auto", "sdpa_segments")
"""The packed attention backends that run context parallelism (fsdptrain/model/attention_backends.py)."""


def _check_context_parallel(cfg: DictConfig) -> None:
    """parallel.cp > 1 with a feature that does not compose with it: one line naming the combination."""
    if cfg.parallel.cp == 1:
        return
    cp = f"parallel.cp={cfg.parallel.cp}"
    if cfg.model.attn_backend not in CP_BACKENDS:
        raise ConfigError(f"{cp} runs on model.attn_backend=auto or sdpa_segments, got {cfg.model.attn_backend!r}")
    refused = (
        (cfg.trainer.share_prompts == "true", "trainer.share_prompts=true", "set trainer.share_prompts=false"),
        (cfg.drafter.enabled, "drafter.enabled=true", "set drafter.enabled=false"),
        (cfg.algorithm.filter_groups, "algorithm.filter_groups=true", "set algorithm.filter_groups=false"),
        (cfg.parallel.compile, "parallel.compile=true", "set parallel.compile=false"),
    )
    for present, setting, fix in refused:
        if present:
            raise ConfigError(f"{cp} does not compose with {setting}: {fix} or parallel.cp=1 (docs/scaling.md)")


def _check_expert_parallel(cfg: DictConfig) -> None:
    """parallel.ep > 1 with a layout or feature it does not compose with: one line naming the combination
    (fsdptrain/distributed/expert_parallel.py; the model itself is checked where it is built)."""
    if cfg.parallel.ep == 1:
        return
    ep = f"parallel.ep={cfg.parallel.ep}"
    refused = (
        (cfg.parallel.dp_replicate > 1, f"parallel.dp_replicate={cfg.parallel.dp_replicate} (HSDP)",
         "set parallel.dp_replicate=1"),
        (cfg.parallel.cp > 1, f"parallel.cp={cfg.parallel.cp}", "set parallel.cp=1"),
        (cfg.model.lora.r > 0, f"model.lora.r={cfg.model.lora.r} (LoRA)", "set model.lora.r=0"),
        (cfg.data.source != "sft" and cfg.rollout.placement == "separate", "rollout.placement=separate",
         "set rollout.placement=colocated"),
        (cfg.parallel.compile, "parallel.compile=true", "set parallel.compile=false"),
        (cfg.parallel.cpu_offload, "parallel.cpu_offload=true", "set parallel.cpu_offload=false"),
    )
    for present, setting, fix in refused:
        if present:
            raise ConfigError(f"{ep} does not compose with {setting}: {fix} or parallel.ep=1 (docs/moe.md)")


def _check_loss_settings(alg: DictConfig) -> None:
    """The algorithm fields that only mean something together with another one (docs/algorithms.md)."""
    if alg.policy_loss == "dro" and alg.dro_beta is None:
        raise ConfigError("algorithm.policy_loss=dro needs algorithm.dro_beta=<its penalty weight, > 0>; it has no "
                          "default (docs/algorithms.md)")
    low = alg.rollout_correction_low
    if low is not None and alg.rollout_correction != "mis":
        raise ConfigError(f"algorithm.rollout_correction_low={low} zeroes weights below it, which only "
                          f"rollout_correction=mis does (got {alg.rollout_correction!r}): set it to mis or the low to null")
    if low is not None and not low < alg.rollout_correction_cap:
        raise ConfigError(f"algorithm.rollout_correction_low={low} must be below "
                          f"algorithm.rollout_correction_cap={alg.rollout_correction_cap}")
    if not alg.rollout_rejection_low < alg.rollout_rejection_high:
        raise ConfigError(f"algorithm.rollout_rejection_low={alg.rollout_rejection_low} must be below "
                          f"algorithm.rollout_rejection_high={alg.rollout_rejection_high}")
    divergence, bound = alg.rollout_rejection_divergence, alg.rollout_rejection_divergence_max
    if divergence != "none" and bound is None:
        raise ConfigError(f"algorithm.rollout_rejection_divergence={divergence} needs "
                          f"algorithm.rollout_rejection_divergence_max=<its upper bound, > 0>; it has no default "
                          f"(docs/off-policy.md)")
    if divergence == "none" and bound is not None:
        raise ConfigError(f"algorithm.rollout_rejection_divergence_max={bound} bounds a divergence, but "
                          f"algorithm.rollout_rejection_divergence is none: set one of "
                          f"{', '.join(names.ROLLOUT_DIVERGENCE_REJECTIONS)}, or the max to null")


EXTENSION_RULES = (check_drafter, check_lora, check_distill, check_routing_replay)
"""Cross-field rules of optional extensions, each registered with one line; they run after the core rules."""


SWITCHES = ("trainer.share_prompts",)
"""Fields that take true, false or auto: Hydra parses ``=true`` to a bool, which the str field holds as 'True'."""


def _normalise_switches(cfg: DictConfig) -> None:
    for key in SWITCHES:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or value in ("True", "False"):
            OmegaConf.update(cfg, key, str(value).lower())


def share_prompts_off_reason(cfg: DictConfig, backend: str) -> Optional[str]:
    """Why ``trainer.share_prompts=auto`` turns shared prompts off for the config and the resolved packed attention
    ``backend``, or None when they allow it (the model's own attention is checked where it is built:
    `fsdptrain/model/attention_backends.py` `shared_prompts_blocker`)."""
    if cfg.drafter.enabled:
        return "drafter.enabled=true reads the unshared packed row"
    if cfg.model.moe.routing_replay:
        return "model.moe.routing_replay=true replays each sample's own routes of its prompt"
    if backend == "torch_varlen":
        return "the packed attention backend torch_varlen takes no keys apart from queries"
    if cfg.parallel.cp > 1:
        return f"parallel.cp={cfg.parallel.cp} splits the packed rows over a context-parallel group"
    if cfg.rollout.n == 1 and cfg.data.source != "jsonl":
        return "rollout.n=1: no prompt repeats in a pack"
    return None


def validate(cfg: DictConfig) -> None:
    """Check every choice, range and cross-field rule of a composed config; raise :class:`ConfigError` on the first."""
    _normalise_switches(cfg)
    _check_choices(cfg)
    _check_ranges(cfg)
    check_sft(cfg)  # before the rules of the parts sft refuses: a setting that does not apply is named as such
    _check_cross_fields(cfg)
    _check_loss_settings(cfg.algorithm)
    _check_steps_and_logging(cfg)
    _check_reward_models(cfg)
    _check_multi_turn(cfg)
    for rule in EXTENSION_RULES:
        rule(cfg)


def validate_mesh_shape(world_size: int, dp_replicate: int, dp_shard: int | None, cp: int = 1) -> tuple[int, int]:
    """Check a (dp_replicate, dp_shard, cp) layout against the world size and return (dp_replicate, dp_shard) with
    `dp_shard` resolved.

    `dp_shard=None` means auto: world_size / (dp_replicate x cp). Pure (no process group, no torch), so the CLI rejects a
    bad layout in the parent before any rank starts; `fsdptrain.distributed.world.build_mesh` applies the same rule.
    Raises ConfigError (a ValueError) with the fix in the message.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    if not isinstance(dp_replicate, int) or dp_replicate < 1:
        raise ConfigError(f"parallel.dp_replicate must be a positive integer, got {dp_replicate!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"parallel.cp must be a positive integer, got {cp!r}")
    if world_size % cp != 0:
        raise ConfigError(f"parallel.cp={cp} does not divide the world size {world_size}: choose a cp that divides "
                          f"{world_size}, or launch a multiple of {cp} processes")
    if cp > 1:  # the data-parallel layout covers world_size / cp ranks; each holds a CP group of cp ranks
        try:
            return validate_mesh_shape(world_size // cp, dp_replicate, dp_shard)
        except ConfigError as error:
            raise ConfigError(f"with parallel.cp={cp} the data-parallel ranks are the world size / cp = "
                              f"{world_size // cp}: {error}") from None
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
    data = cfg.data
    if data.source == "task" or (data.source == "prompts" and data.eval_path is None and data.num_eval_prompts > 0):
        keys.append("data.num_eval_prompts")
    for key in keys:
        if OmegaConf.select(cfg, key) < world_size:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be at least the number of ranks "
                              f"({world_size}): every rank needs a prompt")
    shard = cfg.parallel.dp_shard
    replicate, shard = validate_mesh_shape(world_size, cfg.parallel.dp_replicate,
                                           None if shard == "auto" else int(shard), cfg.parallel.cp)
    if shard % cfg.parallel.ep:
        raise ConfigError(f"parallel.ep={cfg.parallel.ep} must divide the {shard} data-parallel ranks: launch a "
                          f"multiple of {cfg.parallel.ep} ranks or choose an ep that divides {shard} (docs/moe.md)")
    return replicate, shard
