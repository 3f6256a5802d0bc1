"""Crash-safe file writes: a rewrite goes through a temporary file, fsync and ``os.replace``; an append is one write.

A kill at any moment leaves either the old file or the new one, never a truncated mix (docs/checkpoint-trust.md).
Torch-free: the CLI's parent uses it too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data``: written to ``path.tmp-<pid>``, fsynced, renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line with a single ``write`` on an O_APPEND descriptor (a crash leaves at most a partial last line,
    never an interleaving), then flush it to disk."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_dropping_partial_tail(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file; a last line that does not parse (a crash mid-write) is dropped with a
    warning on stderr. A bad line anywhere else is a real corruption and raises ValueError naming it."""
    lines = [line for line in Path(path).read_text(encoding="utf-8", errors="replace").split("\n")]
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if any(rest.strip() for rest in lines[number:]):
                raise ValueError(f"{path}:{number} is not valid JSON (and not the last line): the file is "
                                 f"corrupted; move it aside to resume") from None
            print(f"warning: {path}:{number}: dropped a partial last line (a crash while it was written)",
                  file=sys.stderr, flush=True)
    return rows
