"""Where a pretrained model's weights, config and tokenizer come from: a Hugging Face folder or one GGUF file.

A run names its model with ``model.path`` (a folder, or a ``.gguf`` file) and optionally ``model.gguf_file`` (a
``.gguf`` file inside that folder). ``model_location`` folds the two into one string, the location, which every
loader takes: a folder, or the path of a ``.gguf`` file. ``pretrained_args`` turns a location into the arguments of
transformers' ``from_pretrained``: a GGUF file is read by transformers' own GGUF loader (``gguf_file=...``, the
``gguf`` package), which dequantises the weights (here to fp32: the run's master weights; FSDP2 casts them to
``parallel.param_dtype`` for compute) and rebuilds the tokenizer with its chat template from the file's metadata.
Nothing downloads and no code from the folder runs (``trust_remote_code=False`` at every call site).

Torch-free: the CLI's parent uses it before any rank starts.
"""

from __future__ import annotations

import os
from pathlib import Path

GGUF_SUFFIX = ".gguf"
GGUF_EXTRA = "gguf"
"""The optional extra that brings the ``gguf`` package: ``pip install 'fsdptrain[gguf]'``."""
GGUF_MIN_VERSION = (0, 10)
"""transformers' GGUF loader needs gguf>=0.10."""


def model_location(path: str | None, gguf_file: str | None) -> str | None:
    """The one string every loader takes: ``path`` (a folder or a ``.gguf`` file), or ``path/gguf_file`` when
    ``model.gguf_file`` names a file inside the folder ``path``; None for the config-built model."""
    if path is None:
        return None
    if gguf_file is None:
        return path
    return os.path.join(path, gguf_file)


def is_gguf(location: str | None) -> bool:
    return location is not None and location.lower().endswith(GGUF_SUFFIX)


def pretrained_args(location: str) -> tuple[str, dict[str, str]]:
    """``(name_or_path, extra keyword arguments)`` for transformers' ``from_pretrained`` of a location: a folder as
    it is; a ``.gguf`` file as its folder plus ``gguf_file=<absolute path of the file>``."""
    if not is_gguf(location):
        return location, {}
    file = Path(location).expanduser().resolve()
    return str(file.parent), {"gguf_file": str(file)}


def gguf_package_problem() -> str | None:
    """Why the ``gguf`` package cannot read a GGUF file here (absent, or older than transformers needs), or None."""
    from importlib import metadata

    try:
        version = metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return f"needs the gguf package: pip install 'fsdptrain[{GGUF_EXTRA}]'"
    numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if numbers < GGUF_MIN_VERSION:
        return (f"needs gguf>={'.'.join(map(str, GGUF_MIN_VERSION))} (installed: {version}): "
                f"pip install -U 'fsdptrain[{GGUF_EXTRA}]'")
    return None
