"""Checks of a user's Hugging Face model folder before any rank starts: one line naming what is wrong.

Torch-free and network-free (the CLI's parent runs them): the folder must exist, hold a config naming a causal LM,
weights whose safetensors headers are whole, and a tokenizer. Loading may still fail for reasons only transformers
sees; these are the mistakes users make.
"""

from __future__ import annotations

import json
import pickletools
import re
import struct
import zipfile
from pathlib import Path

from fsdptrain.config import ConfigError
from fsdptrain.model.location import gguf_package_problem, is_gguf, model_location
from fsdptrain.registry.errors import first_line
from fsdptrain.registry.user_paths import check_folder_entries, user_path

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weight files a model folder may hold, in the order transformers prefers them (policy and reward models)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_MAX_HEADER = 100 * 2**20


GGUF_MAGIC = b"GGUF"


def check_model_source(path: str | None, gguf_file: str | None) -> None:
    """Raise ConfigError (one line) unless ``model.path`` / ``model.gguf_file`` name a usable model: a causal-LM
    folder, a ``.gguf`` file, or a ``.gguf`` file inside a folder; a GGUF file also needs the ``gguf`` extra."""
    if gguf_file is None:
        if path is None:
            return
        if is_gguf(path):
            check_gguf_file(path, key="model.path")
        else:
            check_model_folder(path)
        return
    if path is None:
        raise ConfigError(f"model.gguf_file={gguf_file!r} needs model.path=<the folder that holds it>")
    if is_gguf(path):
        raise ConfigError(f"model.gguf_file={gguf_file!r} names a file inside a folder, but model.path={path!r} is "
                          f"already a .gguf file: drop model.gguf_file")
    if not is_gguf(gguf_file):
        raise ConfigError(f"model.gguf_file={gguf_file!r} is not a .gguf file: name the .gguf file inside "
                          f"model.path (or drop model.gguf_file to load the folder's own weights)")
    if not Path(path).expanduser().is_dir():
        raise ConfigError(f"model.path={path!r}: no such folder (model.gguf_file={gguf_file!r} is read from it)")
    check_gguf_file(model_location(path, gguf_file), key="model.gguf_file")


def check_gguf_file(location: str, *, key: str) -> None:
    """A readable file that starts with the GGUF magic, and the ``gguf`` package to read it, or ConfigError."""
    file = Path(location).expanduser()
    if file.exists():
        user_path(location, key=key, expect="file or folder")  # a named pipe is refused before the read below
    if not file.is_file():
        raise ConfigError(f"{key}: {location!r}: no such file" if not file.exists() else
                          f"{key}: {location!r} is a folder, not a .gguf file")
    with file.open("rb") as handle:
        if handle.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ConfigError(f"{key}: {location!r} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    problem = gguf_package_problem()
    if problem is not None:
        raise ConfigError(f"{key}: {location!r} is a GGUF file; reading it {problem}")
    problem = gguf_file_problem(file)
    if problem is not None:
        raise ConfigError(f"{key}: {location!r} is damaged ({problem}): it is cut short or not a whole GGUF file; "
                          f"download or convert it again")


def gguf_file_problem(file: Path) -> str | None:
    """Why the ``gguf`` reader cannot lay out the file's metadata and tensors (a file cut short), or None. The file
    is memory-mapped: no tensor data is read."""
    import gguf

    try:
        gguf.GGUFReader(str(file))
    except Exception as err:  # the reader reports a short file as whatever numpy raises (ValueError, IndexError)
        return f"{type(err).__name__}: {first_line(err)}"
    return None


def check_model_folder(path: str, *, key: str = "model.path") -> None:
    """Raise ConfigError naming ``key`` when ``path`` is not a usable local causal-LM folder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        if _HUB_NAME.match(path) and not path.startswith("."):
            raise ConfigError(f"{key}={path!r} is not a local folder; fsdptrain never downloads (offline mode): "
                              f"fetch it first (huggingface-cli download {path} --local-dir DIR) and set {key}=DIR")
        raise ConfigError(f"{key}={path!r}: no such folder")
    user_path(path, key=key, expect="file or folder")  # a named pipe is refused before anything opens it
    if not folder.is_dir():
        raise ConfigError(f"{key}={path!r} is a file, not a folder: give the folder that holds config.json "
                          f"(or a .gguf file)")
    check_folder_entries(folder, key=key)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{key}={path!r} has no config.json: not a Hugging Face model folder "
                          f"(save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR))")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{key}={path!r}: config.json is not valid JSON ({first_line(err)})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}={path!r}: config.json is not a JSON object")
    check_no_remote_code(folder, where=f"{key}={path!r}")
    _check_causal(config, path, key)
    _check_weights(folder, path, key)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save it into "
                          f"the folder with tokenizer.save_pretrained(DIR)")



def check_tokenizer_fits(tokenizer, path: str, *, key: str = "model.path") -> None:
    """Raise ConfigError naming ``key`` when the folder's tokenizer cannot serve its model: it has neither a pad nor
    an EOS token (generation could not end or pad a batch), or more tokens than the model's embedding has rows (an id
    past the table would crash inside generate). The vocabulary size is config.json's (or its ``text_config``'s)."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}={path!r}: the tokenizer has neither a pad token nor an EOS token; set at least "
                          f"eos_token (e.g. tokenizer.eos_token = '</s>') and save it with save_pretrained")
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return  # check_model_folder reports it
    vocab_size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise ConfigError(f"{key}={path!r}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                          f"{vocab_size} rows (config.json vocab_size); resize the model to the tokenizer "
                          f"(model.resize_token_embeddings(len(tokenizer))) and save both")


def vocabulary_mismatch(student, teacher) -> str | None:
    """Why ``teacher``'s tokenizer cannot score ``student``'s token ids (different sizes, or the first id whose token
    differs), or None when the two share one vocabulary. Distillation reads the teacher's log-prob of the student's
    ids, so an id must mean the same token to both."""
    if len(student) != len(teacher):
        return f"the teacher's tokenizer has {len(teacher)} tokens and the student's {len(student)}"
    teacher_tokens = {index: token for token, index in teacher.get_vocab().items()}
    for token, index in sorted(student.get_vocab().items(), key=lambda item: item[1]):
        if teacher_tokens.get(index) != token:
            return (f"token id {index} is {token!r} to the student and {teacher_tokens.get(index)!r} to the teacher "
                    f"(both have {len(student)} tokens)")
    return None


CODE_MAP_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
"""The files in which a folder can name its own Python code (``auto_map``) for transformers to import."""


def check_no_remote_code(folder: Path, *, where: str) -> None:
    """Refuse a folder that names its own Python code (an ``auto_map`` in ``CODE_MAP_FILES``): fsdptrain never runs
    code from a model folder, and every load passes ``trust_remote_code=False`` so transformers never asks on stdin."""
    for name in CODE_MAP_FILES:
        file = folder / name
        try:
            content = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
        except (OSError, ValueError, UnicodeDecodeError):
            continue  # unreadable files are reported by the checks that read them
        if isinstance(content, dict) and content.get("auto_map"):
            raise ConfigError(f"{where}: {name} has an auto_map (custom model code in the folder's .py files); "
                              f"fsdptrain does not run model code from folders: use a model class transformers "
                              f"implements (docs/your-task.md)")


def _check_causal(config: dict, path: str, key: str) -> None:
    architectures = config.get("architectures") or []
    if architectures:
        if not any(str(a).endswith(CAUSAL_SUFFIXES) for a in architectures):
            raise ConfigError(f"{key}={path!r} holds a {', '.join(map(str, architectures))}, not a causal LM (no "
                              f"*ForCausalLM architecture in config.json): give a causal language model's folder")
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{key}={path!r}: config.json model_type={model_type!r} is not a causal LM transformers "
                          f"knows; give a causal language model's folder")


def _check_weights(folder: Path, path: str, key: str) -> None:
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise ConfigError(f"{key}={path!r} has no weights (none of {', '.join(WEIGHT_FILES)})")
    if present[0] == "pytorch_model.bin":
        _check_pickled_weights(folder / "pytorch_model.bin", path, key)
    if "model.safetensors" in present:
        _check_safetensors(folder / "model.safetensors", path, key)
    elif "model.safetensors.index.json" in present:
        try:
            index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ConfigError(f"{key}={path!r}: model.safetensors.index.json is damaged (no weight_map)") from None
        for shard in shards:
            if not (folder / shard).is_file():
                raise ConfigError(f"{key}={path!r}: weight shard {shard} (listed in the index) is missing")
            _check_safetensors(folder / shard, path, key)


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's header and size, or None when it is whole."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{file.name} is truncated ({size} bytes)"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            return f"{file.name} has a damaged header (declares {header_len} header bytes in a {size}-byte file)"
        try:
            header = json.loads(handle.read(header_len).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return f"{file.name} has a damaged header (not JSON)"
    if not isinstance(header, dict):
        return f"{file.name} has a damaged header (not a JSON object)"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return f"{file.name} has a damaged header (a tensor without data_offsets)"
    if 8 + header_len + end > size:
        return f"{file.name} is truncated ({size} bytes; its header needs {8 + header_len + end})"
    return None


def _check_safetensors(file: Path, path: str, key: str) -> None:
    problem = safetensors_problem(file)
    if problem is not None:
        raise ConfigError(f"{key}={path!r}: {problem}; save or download the weights again")


_TORCH_PICKLE_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device")}
"""The globals a ``torch.save``'d state dict names besides ``torch._utils._rebuild_*``, ``torch.*Storage`` and
dtypes: what torch's safe loader (``weights_only=True``, the one transformers uses) accepts in a weights file."""


def pickle_globals(data: bytes) -> list[str]:
    """The ``module.name`` globals the first pickle in ``data`` names, without unpickling it (``?`` for a name built
    at load time that a scan cannot read); raises ValueError for bytes that are not a whole pickle."""
    names, strings, memo = [], [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING"):
            strings.append(arg)
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
            memo[len(memo) if op.name == "MEMOIZE" else arg] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(arg))
        elif op.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            module, name = (strings[-2:] if len(strings) >= 2 else [None, None])
            names.append(f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else "?")
        elif op.name in ("INST", "OBJ"):
            names.append("?")
    return names


def _torch_safe(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return ((module, attr) in _TORCH_PICKLE_GLOBALS or (module == "torch._utils" and attr.startswith("_rebuild_"))
            or (module == "torch" and (attr.endswith("Storage") or attr in _TORCH_DTYPES)))


_TORCH_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


def _check_pickled_weights(file: Path, path: str, key: str) -> None:
    """A ``pytorch_model.bin`` whose pickle names code (anything but tensors and their containers) is refused by
    torch's safe loader deep inside loading; say so here, in one line, before any rank starts."""
    try:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
                data = archive.read(pickles[0]) if pickles else b""
        else:
            data = file.read_bytes()
            for _ in range(3):  # the legacy format: magic number, protocol, system info, then the state dict
                data = data[_pickle_end(data):]
        names = pickle_globals(data)
    except (ValueError, zipfile.BadZipFile, OSError, IndexError, EOFError):
        raise ConfigError(f"{key}={path!r}: {file.name} is damaged (not a whole torch.save file); save or "
                          f"download the weights again") from None
    unsafe = sorted({name for name in names if not _torch_safe(name)})
    if unsafe:
        raise ConfigError(f"{key}={path!r}: {file.name} is a pickle that names {', '.join(unsafe)} (code, not "
                          f"weights), which torch's safe loader refuses; fsdptrain loads tensors only: save the "
                          f"weights as safetensors (model.save_pretrained(DIR))")


def _pickle_end(data: bytes) -> int:
    """The length of the first pickle in ``data``."""
    end = 0
    for op, _, pos in pickletools.genops(data):
        end = pos + 1
        if op.name == "STOP":
            return end
    raise ValueError("no STOP")
