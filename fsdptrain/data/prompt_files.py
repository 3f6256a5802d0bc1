"""Read a prompt dataset from local files with the ``datasets`` library: never a download, one line per mistake.

A source is one path or a list of paths. A path is a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file, or a folder
written by ``Dataset.save_to_disk``. Anything that is not an existing local path (a hub name such as
``openai/gsm8k``, or anything with a scheme such as ``http://`` or ``hf://``) is a :class:`ConfigError`: the loader
runs with ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` and only ever hands ``datasets`` local file names.

Each file is checked before ``datasets`` sees it (empty, binary, not UTF-8, malformed JSON line, not Parquet), so the
error names the file and the line instead of surfacing as a pyarrow traceback; a failure ``datasets`` still finds
afterwards is wrapped into one line naming the file. Lines in these messages are 1-based, as editors number them.
Files are read one by one (so each error names its file), held in memory, and ``datasets``' cache goes to a temporary
folder that is removed afterwards: nothing is written under the user's home.

Values reach the reward functions as the file wrote them: ``.jsonl``/``.json`` rows are parsed with Python's ``json``
(an ``answer`` of ``7`` stays the int 7 next to a ``0.5``; no column is cast to one type) and ``.csv`` cells are the
strings in the file (``007`` stays ``"007"``; an empty cell is ``""``). Parquet files and ``save_to_disk`` folders are
typed by their own schema and read with ``datasets``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fsdptrain.config import ConfigError
from fsdptrain.registry.errors import first_line
from fsdptrain.registry.user_paths import user_path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class TablePart:
    """One file (or saved folder) of a source, read into memory: ``label`` names it in errors."""

    label: str
    table: object  # a datasets.Dataset


class RowTable:
    """Rows parsed by Python's own readers (JSON, CSV): every row has every column (None where a JSON row lacks one,
    as ``datasets`` would fill it), each value as the file wrote it. Offers what the prompt loader uses of a
    ``datasets.Dataset``: ``column_names``, ``len`` and iteration over the rows as dicts."""

    def __init__(self, rows: list[dict]):
        names: dict[str, None] = {}
        for row in rows:
            names.update(dict.fromkeys(row))
        self.column_names = list(names)
        self._rows = [{name: row.get(name) for name in self.column_names} for row in rows]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)


def read_table(source: str | Sequence[str], *, what: str) -> list[TablePart]:
    """The parts of ``source`` in order, each an in-memory ``datasets.Dataset`` with at least one row.

    ``what`` names the config field in errors (e.g. ``data.path``). Raises ConfigError (one line) for a URL or hub
    name, a missing path, an unknown extension, an empty, binary or non-UTF-8 file, a malformed JSON line, a file
    that is not Parquet, or a folder that is not a saved ``Dataset``.
    """
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not paths:
        raise ConfigError(f"{what}: an empty list of files")
    checked = [_local_path(str(p), what=what) for p in paths]
    datasets = _offline_datasets()
    parts = []
    with tempfile.TemporaryDirectory(prefix="fsdptrain-datasets-") as cache_dir:
        for path in checked:
            table = _read_folder(path, datasets, what) if path.is_dir() else _read_file(path, datasets, cache_dir)
            if len(table) == 0:
                raise ConfigError(f"{path}: no rows")
            parts.append(TablePart(str(path), table))
    return parts


def check_local_paths(source: str | Sequence[str], *, what: str) -> None:
    """Raise ConfigError (one line) unless every path of ``source`` is an existing local file or folder of a known
    kind: the cheap part of :func:`read_table`, for the CLI to run before any rank starts."""
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not paths:
        raise ConfigError(f"{what}: an empty list of files")
    for p in paths:
        _local_path(str(p), what=what)


def _local_path(text: str, *, what: str) -> Path:
    if _SCHEME.match(text):
        raise ConfigError(f"{what}={text!r}: only local files are read (no URLs, no hub datasets); "
                          f"download it yourself and pass the local path")
    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(f"{what}={text!r}: no such file or folder (hub dataset names are not downloaded; "
                          f"pass a local .jsonl, .json, .parquet or .csv file, or a save_to_disk folder)")
    user_path(path, key=what, expect="file or folder")  # before any read: a named pipe would hold the read forever
    if path.is_file() and path.suffix.lower() not in FORMATS:
        raise ConfigError(f"{what}={text!r}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
    return path


def _offline_datasets():
    # Set before (and after) import: datasets reads these at import, huggingface_hub at each call.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # our ConfigError says it once
    return datasets


def _read_folder(path: Path, datasets, what: str):
    try:
        table = datasets.load_from_disk(str(path), keep_in_memory=True)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise ConfigError(f"{what}={str(path)!r}: not a folder written by Dataset.save_to_disk "
                          f"({first_line(err)})") from None
    except Exception as err:  # damaged metadata (state.json, dataset_info.json) fails in datasets as anything
        raise ConfigError(f"{what}={str(path)!r}: a Dataset.save_to_disk folder whose metadata is damaged "
                          f"({type(err).__name__}: {first_line(err)}); save it again") from None
    if isinstance(table, datasets.DatasetDict):
        raise ConfigError(f"{path}: a DatasetDict with splits {sorted(table)}; pass one split's folder, "
                          f"e.g. {path / sorted(table)[0]}")
    return table


def _read_file(path: Path, datasets, cache_dir: str):
    builder = FORMATS[path.suffix.lower()]
    if builder != "parquet":
        text = _check_text(path)
        return RowTable(_json_rows(path, text) if builder == "json" else _csv_rows(path, text))
    _check_parquet(path)
    try:
        return datasets.load_dataset(builder, data_files=[str(path)], split="train", keep_in_memory=True,
                                     cache_dir=cache_dir)
    except Exception as err:  # datasets wraps pyarrow's errors in its own; surface the root cause in one line
        raise ConfigError(f"{path}: cannot read as a {builder} table: {_root_cause(err)}") from None


def _check_parquet(path: Path) -> None:
    with path.open("rb") as handle:
        head = handle.read(4)
        handle.seek(max(path.stat().st_size - 4, 0))
        tail = handle.read(4)
    if path.stat().st_size == 0:
        raise ConfigError(f"{path}: empty file")
    if head != b"PAR1" or tail != b"PAR1":
        raise ConfigError(f"{path}: not a Parquet file (no PAR1 magic bytes)")


def _check_text(path: Path) -> str:
    """The file's UTF-8 text (a leading byte-order mark dropped), or ConfigError for an empty, binary or other file."""
    data = path.read_bytes()
    if not data.strip():
        raise ConfigError(f"{path}: empty file")
    if b"\x00" in data:
        line = data[:data.index(b"\x00")].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line}: binary data (a NUL byte); expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line}: not UTF-8 text (byte {data[err.start]:#04x})") from None
    return text.removeprefix("\ufeff")


def _csv_rows(path: Path, text: str) -> list[dict]:
    """The CSV's rows as ``{header: cell string}``: a duplicate header or a row with more cells than the header is an
    error naming the line."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if not header:
        raise ConfigError(f"{path}: no header line")
    duplicate = sorted({name for name in header if header.count(name) > 1})
    if duplicate:
        raise ConfigError(f"{path}: line 1: the header repeats the column {duplicate[0]!r}")
    rows = []
    for cells in reader:
        if not cells:
            continue
        if len(cells) > len(header):
            raise ConfigError(f"{path}: line {reader.line_num}: {len(cells)} cells for {len(header)} columns")
        rows.append(dict(zip(header, cells + [""] * (len(header) - len(cells)))))
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


def _json_rows(path: Path, text: str) -> list[dict]:
    """The rows of a JSON array of objects, or of a JSON-lines file (blank lines skipped)."""
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: line {err.lineno}: invalid JSON ({err.msg})") from None
        if not rows:
            raise ConfigError(f"{path}: empty JSON array")
        if not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{path}: expected a JSON array of objects (one per row)")
        return rows
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: line {line_no}: invalid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: line {line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {first_line(err)}"

