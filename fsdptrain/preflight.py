"""Checks of everything the user points at, in the CLI's parent before any rank starts (one line, exit 2, once).

Model folders, data files and their rows, the user's functions (rewards, estimators, losses, tools), reward model
folders, trackers, which command reads which data source, the run directory, output paths, the device and the
attention backend: ``check_train_inputs`` and ``check_sft_inputs`` gather what each command needs. Under
``--nproc N`` a mistake is reported once by the parent instead of as a collective error from every rank. Torch is
imported only to check a device or backend the user named.
"""

from __future__ import annotations

import codecs
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fsdptrain.config import ConfigError
from fsdptrain.registry.user_paths import output_path, user_path

MIN_FREE_BYTES = 16 * 2**20
"""A run directory on a file system with less free space than this is refused before the run starts."""
_CHUNK = 1 << 20


def check_inputs(cfg: DictConfig) -> None:
    """The model folder, the data file, the device and the attention backend of ``cfg``."""
    if cfg.model.path is not None or cfg.model.gguf_file is not None:
        from fsdptrain.model.checks import check_model_source

        check_model_source(cfg.model.path, cfg.model.gguf_file)
    if cfg.data.source == "jsonl":
        check_text_file(cfg.data.path, key="data.path")
    if cfg.algorithm.distill.teacher is not None:
        check_teacher(cfg)
    check_device(cfg)
    if cfg.model.lora.r > 0:
        check_lora_targets(cfg)
    if cfg.model.path is not None:
        check_moe_settings(cfg)


def check_moe_settings(cfg: DictConfig) -> None:
    """What a mixture-of-experts model (docs/moe.md) does not run with, in one line each: a critic where transformers
    has no token-classification class for the architecture (OLMoE), context parallelism and the co-trained drafter
    (their forwards would not pass the load-balancing loss its routes). The architecture is built on the meta
    device: no weights are read. Dense models pass untouched."""
    from transformers import AutoModelForTokenClassification

    from fsdptrain.model.loading import meta_model, model_path, resolve_config
    from fsdptrain.model.moe import moe_layers

    config = resolve_config(path=model_path(cfg), config=None)
    if not moe_layers(meta_model("policy", config)):
        return
    arch = f"model.path={cfg.model.path!r} is a mixture-of-experts {config.model_type}"
    if cfg.algorithm.use_critic and type(config) not in AutoModelForTokenClassification._model_mapping:
        raise ConfigError(f"{arch}, for which transformers has no value-model (token-classification) class: train it "
                          f"without a critic (algorithm=grpo, or algorithm.use_critic=false) (docs/moe.md)")
    for present, setting, fix in ((cfg.parallel.cp > 1, f"parallel.cp={cfg.parallel.cp}", "parallel.cp=1"),
                                  (cfg.drafter.enabled, "drafter.enabled=true", "drafter.enabled=false")):
        if present:
            raise ConfigError(f"{arch}: {setting} is not supported with mixture-of-experts models yet: set {fix} "
                              f"(docs/moe.md, \"What is refused\")")


def check_training_data(cfg: DictConfig) -> None:
    """``fsdptrain train``'s rows, read here exactly as the ranks will read them (every bad row, every setting the
    rows contradict), and ``trainer.token_budget`` against the longest sequence they can make: before the run folder
    is claimed, so such a mistake is one line and exit 2 with nothing written (docs/checkpoint-trust.md).

    Offline rows (``data=jsonl``) give their sequences exactly; a sampled single-turn row can reach its prompt plus
    ``rollout.max_new_tokens``. A multi-turn prompt is rendered with the tools by the ranks (its budget is checked
    there)."""
    from fsdptrain.config import multi_turn
    from fsdptrain.model.loading import build_tokenizer

    tokenizer = build_tokenizer(cfg)
    budget, max_new = cfg.trainer.token_budget, cfg.rollout.max_new_tokens
    if cfg.data.source == "jsonl":
        from fsdptrain.data.offline_rollouts import load_jsonl_rollouts

        rollouts, _ = load_jsonl_rollouts(cfg.data.path, tokenizer, max_response_length=max_new,
                                          skip_bad_rows=cfg.data.skip_bad_rows)
        longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
        if longest > budget:
            raise ConfigError(f"trainer.token_budget={budget} is smaller than a sequence of {longest} tokens "
                              f"(prompt + response) in data.path: raise trainer.token_budget to at least {longest}")
        return
    from fsdptrain.data.prompts import prompt_token_ids
    from fsdptrain.rollout.prompt_source import load_rows

    train, _, _ = load_rows(cfg, tokenizer)
    if multi_turn(cfg):
        return
    prompt = max(len(prompt_token_ids(tokenizer, row)) for row in train)
    if prompt + max_new > budget:
        raise ConfigError(f"trainer.token_budget={budget} is smaller than a sequence of {prompt + max_new} tokens "
                          f"this run can make (its longest prompt, {prompt} tokens, + rollout.max_new_tokens="
                          f"{max_new}): raise trainer.token_budget to at least {prompt + max_new}")


def check_teacher(cfg: DictConfig) -> None:
    """``algorithm.distill.teacher`` is a usable causal-LM folder or GGUF file whose tokenizer is the student's
    (docs/algorithms.md, "On-policy distillation"); loads both tokenizers, no weights."""
    from transformers import AutoTokenizer

    from fsdptrain.model.checks import check_gguf_file, check_model_folder, check_tokenizer_fits, vocabulary_mismatch
    from fsdptrain.model.location import is_gguf, pretrained_args
    from fsdptrain.model.loading import build_tokenizer

    key, teacher = "algorithm.distill.teacher", cfg.algorithm.distill.teacher
    if is_gguf(teacher):
        check_gguf_file(teacher, key=key)
    else:
        check_model_folder(teacher, key=key)
    name, gguf = pretrained_args(teacher)
    teacher_tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False, **gguf)
    check_tokenizer_fits(teacher_tokenizer, teacher, key=key)
    problem = vocabulary_mismatch(build_tokenizer(cfg), teacher_tokenizer)
    if problem is not None:
        raise ConfigError(f"{key}={teacher!r} cannot score the student's tokens: {problem}; distill from a teacher "
                          "with the student's tokenizer (docs/algorithms.md, \"On-policy distillation\")")


def check_lora_targets(cfg: DictConfig) -> None:
    """peft is installed, and ``model.lora.target_modules`` names linear modules of the model's decoder layers (the
    architecture is built on the meta device: no weights are read)."""
    import importlib.util

    from fsdptrain.model.lora import PEFT_MISSING

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(PEFT_MISSING)
    from fsdptrain.config.lora_rules import target_module_names
    from fsdptrain.model.loading import meta_model, resolve_config
    from fsdptrain.model.lora import resolve_target_modules
    from fsdptrain.model.loading import tiny_model_config
    from fsdptrain.model.loading import build_tokenizer

    source = (dict(path=cfg.model.path, config=None) if cfg.model.path is not None else
              dict(path=None, config=tiny_model_config(cfg, build_tokenizer(cfg))))
    names = target_module_names(cfg.model.lora.target_modules)
    try:
        resolve_target_modules(meta_model("policy", resolve_config(**source)), None if names is None else tuple(names))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_text_file(path: str, *, key: str) -> None:
    """A readable UTF-8 text file (no NUL bytes), or ConfigError naming ``key``."""
    file = user_path(path, key=key)  # what it is, before any read
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise ConfigError(f"{key}={path!r} is a binary file (a NUL byte at offset {offset + nul}), "
                                      f"not JSONL text")
                decoder.decode(chunk)
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{key}={path!r} is not UTF-8 text (byte {err.object[err.start]:#04x} near offset "
                          f"{offset + err.start}): save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{key}={path!r} cannot be read ({err.strerror})") from None


def check_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` if needed and prove it is a writable folder with space, or raise ConfigError."""
    for ancestor in [run_dir, *run_dir.parents]:
        if ancestor.exists() or ancestor.is_symlink():
            if not ancestor.is_dir():
                what = "is a file" if ancestor == run_dir else f"is under {ancestor}, which is a file"
                raise ConfigError(f"run directory {run_dir} {what}: choose another trainer.run_name or "
                                  f"trainer.run_dir")
            break
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_probe-{os.getpid()}"
        with open(probe, "wb") as handle:
            handle.write(b"x")
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"run directory {run_dir} is not writable ({err.strerror}): choose another "
                          f"trainer.run_dir") from None
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise ConfigError(f"run directory {run_dir} has no space left ({free // 2**20} MiB free): free some space "
                          f"or choose another trainer.run_dir")


def check_output_file(path: Path, *, option: str) -> None:
    """A file the command will write at its end: not a named pipe or a folder (`output_path`), its folder exists and
    a file can be created there now."""
    output_path(path, option=option)
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder: give a file path")
    if not path.parent.is_dir():
        raise ConfigError(f"{option} {path}: the folder {path.parent} does not exist; create it or choose another")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise ConfigError(f"{option} {path} cannot be written ({err.strerror}): choose another path") from None
    if not existed:
        path.unlink()


def check_device(cfg: DictConfig) -> None:
    """``trainer.device=cuda`` needs a GPU; a named attention backend must run on the device the run will use."""
    if cfg.trainer.device != "cuda" and cfg.model.attn_backend == "auto":
        return
    import torch

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA GPU is available here: use trainer.device=cpu or auto")
    if cfg.model.attn_backend == "auto":
        return
    from fsdptrain.model.attention_switch import available_backends

    device = cfg.trainer.device if cfg.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cfg.parallel.param_dtype)
    available = available_backends(torch.device(device), dtype)
    if cfg.model.attn_backend not in available:
        raise ConfigError(f"model.attn_backend={cfg.model.attn_backend} is not available on {device} for "
                          f"{cfg.parallel.param_dtype}; available here: {', '.join(available)} (or auto)")


def check_user_functions(cfg: DictConfig) -> None:
    """Load every user function the config names (an advantage estimator, a policy loss) and check its signature,
    here in the parent, so a typo or a function that does not fit is one line and exit 2."""
    from fsdptrain.registry.names import USER_FUNCTION_FIELDS
    from fsdptrain.registry.plugins import registered
    from fsdptrain.registry.user_functions import check_signature, load_callable

    for key, required in USER_FUNCTION_FIELDS.items():
        spec = str(OmegaConf.select(cfg, key))
        if ":" in spec:
            check_signature(load_callable(spec, what=key), spec=spec, what=key, required=required)
        elif spec in registered(key):  # a name a plugin registered (validation imported algorithm.plugins)
            check_signature(registered(key)[spec], spec=spec, what=key, required=required)


def check_train_inputs(cfg: DictConfig) -> None:
    """What the parent can check before any rank starts: data paths are local, the reward functions load with their
    signatures, each reward model folder is a one-label sequence classifier with a tokenizer (this imports torch), the
    trackers' libraries are installed. Raises ConfigError."""
    if cfg.data.source == "jsonl":
        return
    from fsdptrain.config import multi_turn, reward_specs
    from fsdptrain.rewards.loading import load_reward_functions
    from fsdptrain.run.trackers import missing_backend_message

    if cfg.data.source == "prompts":
        _check_data_paths(cfg)
    weights = None if cfg.reward.weights is None else list(cfg.reward.weights)
    if reward_specs(cfg):
        load_reward_functions(reward_specs(cfg), weights)
    if cfg.reward.models:  # headers and tokenizers only; transformers (and torch) load just for this
        from fsdptrain.model.reward_model import load_reward_model_spec

        for path in cfg.reward.models:
            load_reward_model_spec(path)
    if cfg.rollout.agent is not None:
        from fsdptrain.rollout.agents import check_agent

        check_agent(cfg)
    elif multi_turn(cfg):
        from fsdptrain.rollout.multi_turn import check_multi_turn

        check_multi_turn(cfg)
    missing = missing_backend_message(cfg.logging.backends)
    if missing is not None:
        raise ConfigError(missing)


def check_sft_inputs(cfg: DictConfig) -> None:
    """``fsdptrain sft``'s checks in the parent: the data paths are local, and every demonstration renders within
    the token budget with an assistant turn to train on (this loads the tokenizer, so torch), so a bad row is one
    line and exit 2 before any run folder exists (docs/sft.md)."""
    from fsdptrain.model.loading import build_tokenizer
    from fsdptrain.run.trackers import missing_backend_message
    from fsdptrain.train.sft import load_sft_rows

    _check_data_paths(cfg)
    check_inputs(cfg)  # the model folder first: its tokenizer renders the rows
    load_sft_rows(cfg, build_tokenizer(cfg))
    missing = missing_backend_message(cfg.logging.backends)
    if missing is not None:
        raise ConfigError(missing)


def check_command_source(command: str, cfg: DictConfig) -> None:
    """``data.source=sft`` is ``fsdptrain sft``'s (and check-metrics'), and ``fsdptrain sft`` reads nothing else."""
    if command == "sft" and cfg.data.source != "sft":
        raise ConfigError(f"fsdptrain sft reads demonstrations: data.source={cfg.data.source} is for fsdptrain "
                          "train; drop the data=... override (fsdptrain sft selects data=sft)")
    if command in ("train", "check-reward") and cfg.data.source == "sft":
        raise ConfigError(f"data.source=sft (demonstrations) is for fsdptrain sft, not fsdptrain {command}: run "
                          "fsdptrain sft model.path=... data.path=... (docs/sft.md)")


def _check_data_paths(cfg: DictConfig) -> None:
    """``data.path`` and ``data.eval_path`` name local files (ConfigError otherwise)."""
    from fsdptrain.data.prompt_files import check_local_paths

    def plain(value):
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    check_local_paths(plain(cfg.data.path), what="data.path")
    if cfg.data.eval_path is not None:
        check_local_paths(plain(cfg.data.eval_path), what="data.eval_path")
