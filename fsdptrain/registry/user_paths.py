"""What a path the user named is, established with ``stat`` before anything opens it (docs/your-task.md, "Paths").

Opening a named pipe (FIFO) blocks until another process opens its other end, and reading a character device such as
``/dev/zero`` never ends: an ordinary open-and-read of such a path holds the CLI forever, before any message. So every
path the user names (data files, model and teacher folders, reward and tool files, config folders, output paths) is
first classified here from its ``stat``, which never opens it, and anything that is neither a regular file nor the
folder the source expects is refused with one line naming the option and what the path is. Torch-free.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal, Optional

from fsdptrain.registry.errors import ConfigError

Expect = Literal["file", "folder", "file or folder"]

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"))


def path_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words (``a named pipe (FIFO)``, ``a folder``, ``a regular file``...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a file or folder")


def _stat(path: Path) -> Optional[os.stat_result]:
    try:
        return path.stat()  # follows a link to what it names; never opens the path
    except FileNotFoundError:
        return None
    except OSError as err:  # a loop of links, a name too long, a folder on the way that is not searchable
        raise ConfigError(f"{path} cannot be examined ({err.strerror})") from None


def user_path(text: str | os.PathLike, *, key: str, expect: Expect = "file") -> Path:
    """``text`` as a Path once ``stat`` shows it is what the source ``key`` expects: a regular file, a folder, or
    either; ConfigError (one line naming ``key``) when it does not exist or is anything else (a named pipe, a
    socket, a device)."""
    path = Path(text).expanduser()
    found = _stat(path)
    if found is None:
        raise ConfigError(f"{key}={str(text)!r}: no such {'file or folder' if expect == 'file or folder' else expect}")
    regular, folder = stat.S_ISREG(found.st_mode), stat.S_ISDIR(found.st_mode)
    if (regular and expect != "folder") or (folder and expect != "file"):
        return path
    wanted = {"file": "a regular file", "folder": "a folder", "file or folder": "a regular file or a folder"}[expect]
    raise ConfigError(f"{key}={str(text)!r} is {path_kind(found.st_mode)}, not {wanted}: fsdptrain reads only "
                      f"{wanted} there (docs/your-task.md, \"Paths\")")


def check_folder_entries(folder: Path, *, key: str) -> None:
    """Every entry of the user's ``folder`` (a model's, a reward model's) is a regular file or a folder: a named pipe
    or a device inside it would hold whatever library opens it (a tokenizer's files, config.json)."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        found = _stat(Path(entry.path))
        if found is not None and not (stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode)):
            raise ConfigError(f"{key}={str(folder)!r}: {entry.name} is {path_kind(found.st_mode)}, not a regular "
                              f"file: fsdptrain reads only regular files there (docs/your-task.md, \"Paths\")")


def output_path(path: Path, *, option: str) -> None:
    """A path the command will write: absent, a regular file, or a character device such as ``/dev/null`` (written
    without blocking); a named pipe, a socket or a folder is refused (opening a pipe to write blocks until a reader
    comes)."""
    found = _stat(path)
    if found is None or stat.S_ISREG(found.st_mode) or stat.S_ISCHR(found.st_mode):
        return
    raise ConfigError(f"{option} {path} is {path_kind(found.st_mode)}, not a file: give a file path "
                      f"(docs/your-task.md, \"Paths\")")
