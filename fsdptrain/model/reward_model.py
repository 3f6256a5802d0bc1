"""Learned reward models: load and check a local sequence-classification folder, re-tokenise, score packed rows.

Legend: `_T` per-token tensors of one packed row, `_N` one value per sequence.

A reward model is a local Hugging Face folder of an `AutoModelForSequenceClassification` with `num_labels=1` and its
own tokenizer (docs/reward-models.md). Nothing here touches the network: every load passes `local_files_only=True`
and the path must be an existing folder. Every mistake a user can make in the folder is a one-line ConfigError naming
it, raised on every rank before any weight is read (the checks read headers only).

Scoring departs from transformers' own head in one way: `*ForSequenceClassification.forward` pools at the last token
that is not `pad_token_id`, which in a packed row is the row's end (or a pad token inside a sequence). Here the score
head's output is captured for every position and read at each sequence's own last token, `cu_seqlens[1:] - 1`.
The FSDP2-sharded build (a frozen model like the reference model) is in fsdptrain/distributed/fsdp_reward_models.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import render_ids, render_ids_as_data, without_special_tokens
from fsdptrain.data.packing import PackedBatch, pack_sequences
from fsdptrain.model.attention_backends import BACKENDS
from fsdptrain.model.attention_switch import packed_model_inputs
from fsdptrain.model.loading import zero_dropout_in_config, zero_dropout_modules
from fsdptrain.model.checks import WEIGHT_FILES, check_no_remote_code
from fsdptrain.registry.errors import first_line
from fsdptrain.registry.user_paths import check_folder_entries

HEAD = "score"
"""The name of transformers' sequence-classification head (`nn.Linear(hidden, num_labels)`)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class RewardModelSpec:
    """A checked reward-model folder: its config (dropout 0, one label) and its own tokenizer."""

    path: str
    config: PretrainedConfig
    tokenizer: object  # a transformers tokenizer

    @property
    def architecture(self) -> str:
        return self.config.architectures[0]

    @property
    def uses_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


# ---------------------------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------------------------


def load_reward_model_spec(path: str | os.PathLike) -> RewardModelSpec:
    """Check the folder `path` and load its config and tokenizer (not its weights). Local files only.

    Raises ConfigError (one line naming the folder) for: a missing path or one that is not a folder, no or an
    unreadable config.json, an architecture that is not `*ForSequenceClassification` (a causal LM included),
    num_labels != 1, no head named `score`, no or unloadable tokenizer files, and missing, unreadable or headless
    weights.
    """
    folder = Path(path)
    where = f"reward model {str(folder)!r}"
    if not folder.exists():
        raise ConfigError(f"{where} does not exist; give the local folder of a sequence-classification model")
    if not folder.is_dir():
        raise ConfigError(f"{where} is not a folder; give the folder that holds config.json, weights and tokenizer")
    check_folder_entries(folder, key="reward.models")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json; save the model with save_pretrained")
    check_no_remote_code(folder, where=where)
    config = _load_config(folder, where)
    _check_architecture(config, where)
    _check_head(config, where)
    tokenizer = _load_tokenizer(folder, where)
    _check_weights(folder, where)
    return RewardModelSpec(path=str(folder), config=config, tokenizer=tokenizer)


def _load_config(folder: Path, where: str) -> PretrainedConfig:
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # corrupt JSON, unknown model_type, custom code: all the user's folder
        raise ConfigError(f"{where}: cannot read config.json ({type(err).__name__}: {first_line(err)})") from err
    zero_dropout_in_config(config)
    return config


def _check_architecture(config: PretrainedConfig, where: str) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        raise ConfigError(f"{where}: config.json names no architectures; expected e.g. LlamaForSequenceClassification")
    bad = [a for a in archs if not a.endswith("ForSequenceClassification")]
    if bad:
        kind = "a causal LM" if any(a.endswith("ForCausalLM") for a in bad) else "not a sequence classifier"
        raise ConfigError(
            f"{where} is {kind} ({', '.join(archs)}); a reward model is an AutoModelForSequenceClassification "
            f"with num_labels=1"
        )
    if config.num_labels != 1:
        raise ConfigError(f"{where} has num_labels={config.num_labels}; a reward model gives one score (num_labels=1)")


def _check_head(config: PretrainedConfig, where: str) -> None:
    """The score head must be an `nn.Linear` named `score` with one output (built on the meta device: no memory)."""
    try:
        model = _meta_reward_model(config)
    except Exception as err:
        raise ConfigError(f"{where}: transformers cannot build it ({type(err).__name__}: {first_line(err)})") from err
    head = getattr(model, HEAD, None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ConfigError(f"{where}: {type(model).__name__} has no one-output nn.Linear head named {HEAD!r}")


def _load_tokenizer(folder: Path, where: str):
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(
            f"{where} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); a reward model re-tokenises the "
            f"text with its own tokenizer: save it into the folder with tokenizer.save_pretrained"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:
        raise ConfigError(f"{where}: cannot load its tokenizer ({type(err).__name__}: {first_line(err)})") from err


def _check_weights(folder: Path, where: str) -> None:
    """The weight files exist, their headers parse and they hold the score head (a causal LM's weights do not)."""
    found = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not found:
        raise ConfigError(f"{where} has no weights ({' or '.join(WEIGHT_FILES)})")
    name = found[0]
    try:
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
            keys = set()
            for shard in shards:
                keys |= _weight_keys(folder / shard)
        else:
            keys = _weight_keys(folder / name)
    except Exception as err:
        raise ConfigError(f"{where}: unreadable weights in {name} ({type(err).__name__}: {first_line(err)})") from err
    if not any(key == f"{HEAD}.weight" or key.endswith(f".{HEAD}.weight") for key in keys):
        raise ConfigError(f"{where}: the weights in {name} hold no {HEAD}.weight (the weights of a causal LM?)")


def _weight_keys(file: Path) -> set[str]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:  # parses and size-checks the header only
            return set(handle.keys())
    return set(torch.load(file, map_location="cpu", weights_only=True, mmap=True).keys())



def _meta_reward_model(config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    zero_dropout_modules(model)
    return model


def load_full_reward_model(spec: RewardModelSpec) -> PreTrainedModel:
    """The whole fp32 reward model on the CPU, frozen and in eval mode (rank 0 of a sharded build; tests).

    Raises ConfigError when transformers reports weights that are missing from the files (they would be drawn at
    random and the scores would mean nothing) or that do not load.
    """
    where = f"reward model {spec.path!r}"
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            spec.path, config=spec.config, dtype=torch.float32, local_files_only=True, output_loading_info=True,
            trust_remote_code=False,
        )
    except Exception as err:
        raise ConfigError(f"{where}: cannot load its weights ({type(err).__name__}: {first_line(err)})") from err
    if info.get("missing_keys"):
        raise ConfigError(f"{where}: its weights lack {sorted(info['missing_keys'])[:3]} (and maybe more)")
    zero_dropout_modules(model)
    model.requires_grad_(False)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# Re-tokenisation
# ---------------------------------------------------------------------------------------------------------------


def _conversation_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """The template's ids of ``conversation`` with every content tokenized as data (no special token comes out of
    a prompt, a completion or a tool result); a template that rewrites contents gets them with every special
    token's string removed instead."""
    ids = render_ids_as_data(tokenizer, conversation, tools=None, add_generation_prompt=False)
    if ids is not None:
        return ids
    cleaned = [{**m, "content": without_special_tokens(tokenizer, m["content"])} if isinstance(m.get("content"), str)
               else m for m in conversation]
    return render_ids(tokenizer, cleaned, tools=None, add_generation_prompt=False)


def reward_input_ids(spec: RewardModelSpec, prompt: str, completion: str, *,
                     messages: Optional[Sequence[dict]] = None) -> list[int]:
    """The reward model's own token ids for one prompt/completion pair of TEXT.

    With a chat template: the template applied to [user: prompt, assistant: completion] (no generation prompt), or
    to ``messages`` when given (a multi-turn sample's whole conversation: the prompt's messages, the assistant turns
    with their tool calls, the tool messages; as TRL passes conversational samples), tokenised without adding special
    tokens (the template writes its own). Without one: the plain concatenation `prompt + completion` (no separator
    added: the texts carry their own whitespace), tokenised with the tokenizer's default special tokens (e.g. its
    BOS). Raises ValueError if that gives no token at all, or if the template cannot render ``messages``.
    """
    tokenizer = spec.tokenizer
    if spec.uses_chat_template:
        conversation = list(messages) if messages is not None else [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        try:
            ids = _conversation_ids(tokenizer, conversation)
        except Exception as err:  # a template that only knows user/assistant turns rejects tool messages
            if messages is None:
                raise
            raise ValueError(f"reward model {spec.path!r}: its chat template cannot render a multi-turn conversation "
                             f"(tool calls and tool messages): {err}; use a reward model whose template renders "
                             f"tool messages (docs/reward-models.md)") from err
    else:
        ids = tokenizer(prompt + completion, split_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError(f"reward model {spec.path!r}: the prompt and completion tokenise to no token at all")
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------------------------
# Packed scoring
# ---------------------------------------------------------------------------------------------------------------


def score_packed(model: nn.Module, packed: PackedBatch) -> Tensor:
    """Each sequence's score, read at its own last token: float32 `[num_seqs]` (`[0]` for an empty pack).

    `model` is a `*ForSequenceClassification` (plain or FSDP2-sharded) already switched to a packed attention
    backend (fsdptrain.model.attention_switch.set_attention / packed_attention); the root model's forward runs once over the row
    (so FSDP's root hooks run, an empty pack included) and the `score` head's per-token output is read at
    `cu_seqlens[1:] - 1`, never at the row's end or the padding tail.
    """
    backend = model.config._attn_implementation
    if backend not in BACKENDS:
        raise ValueError(
            f"the reward model runs on {backend!r}, which may attend across the sequences of a packed row; switch it "
            f"to one of {', '.join(BACKENDS)} with fsdptrain.model.attention_switch.set_attention"
        )
    captured: dict[str, Tensor] = {}

    def keep_output(_module, _inputs, output):
        captured["scores_T"] = output[0, :, 0]

    handle = getattr(model, HEAD).register_forward_hook(keep_output)
    try:
        with torch.no_grad():
            model(**packed_model_inputs(packed))
    finally:
        handle.remove()
    scores_T = captured["scores_T"]
    ends = packed.cu_seqlens[1:].to(device=scores_T.device, dtype=torch.long) - 1
    return scores_T[ends].float()


def score_sequences(
    model: nn.Module,
    input_ids: Sequence[Sequence[int]],
    packs: Sequence[Sequence[int]],
    *,
    device: torch.device | str,
) -> Tensor:
    """Scores `[N]` (float32, CPU) of the sequences `input_ids`, packed as `packs` (indices into `input_ids`).

    `packs` comes from the caller's planner (e.g. `fsdptrain.distributed.collectives.plan_agreed`, so every rank runs the same number of
    forwards; an empty pack still runs one). Every index must appear in exactly one pack. Call `model.reshard()`
    after the scoring phase when `model` is sharded, to free its root unit.
    """
    scores = torch.full((len(input_ids),), float("nan"), dtype=torch.float32)
    seen = sorted(i for pack in packs for i in pack)
    assert seen == list(range(len(input_ids))), "every sequence must be in exactly one pack"
    empty_responses = [[] for _ in input_ids]
    for pack in packs:
        packed = pack_sequences(input_ids, empty_responses, list(pack)).to(device)
        scores[list(pack)] = score_packed(model, packed).cpu()
    return scores
