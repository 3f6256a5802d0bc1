"""`fsdptrain/registry/user_paths.py`: what a user's path is, from its stat alone (issue 56, class 1)."""

from __future__ import annotations

import os
import socket

import pytest

from fsdptrain.config import ConfigError
from fsdptrain.registry.user_paths import check_folder_entries, output_path, user_path


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "file.jsonl").write_text("{}\n")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "pipe.jsonl")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    yield tmp_path
    sock.close()


@pytest.mark.parametrize(("name", "expect", "refused"), [
    ("file.jsonl", "file", None), ("folder", "folder", None), ("file.jsonl", "file or folder", None),
    ("folder", "file or folder", None), ("folder", "file", "is a folder, not a regular file"),
    ("file.jsonl", "folder", "is a regular file, not a folder"), ("pipe.jsonl", "file", "is a named pipe (FIFO)"),
    ("pipe.jsonl", "file or folder", "is a named pipe (FIFO)"), ("sock", "file", "is a socket"),
    ("/dev/zero", "file", "is a character device"), ("missing.jsonl", "file", "no such file"),
])
def test_user_path_is_what_the_source_expects_or_one_line(paths, name, expect, refused):
    target = name if name.startswith("/") else str(paths / name)
    if refused is None:
        assert user_path(target, key="data.path", expect=expect) == paths / name
        return
    with pytest.raises(ConfigError, match="data.path=") as err:
        user_path(target, key="data.path", expect=expect)
    assert refused in str(err.value)


def test_a_folder_holding_a_pipe_names_the_entry(paths):
    with pytest.raises(ConfigError, match="pipe.jsonl is a named pipe"):
        check_folder_entries(paths, key="model.path")
    check_folder_entries(paths / "folder", key="model.path")


@pytest.mark.parametrize(("name", "refused"), [("file.jsonl", None), ("new.json", None), ("/dev/null", None),
                                               ("pipe.jsonl", "named pipe"), ("folder", "is a folder")])
def test_an_output_is_a_file_or_a_device_never_a_pipe(paths, name, refused):
    target = paths / name
    if refused is None:
        output_path(target, option="--json")
        return
    with pytest.raises(ConfigError, match=f"--json .* {refused}"):
        output_path(target, option="--json")
