"""Test patch (never part of the product): kill the process inside DCP's FileSystemWriter.write_data on its 2nd call.

The test puts this folder on PYTHONPATH for one launch. The patch waits until torch.distributed.checkpoint.filesystem
is imported (a meta path finder, so the launcher process does not import torch for nothing), then wraps write_data:
the second call writes its data files, waits for them, and exits with os._exit(9) before DCP writes `.metadata` or
fsdptrain writes its marker: a save that died half-way, with files on disk.
"""

import importlib.abc
import os
import sys

TARGET = "torch.distributed.checkpoint.filesystem"
CRASH_ON_CALL = 2


def _patch(module):
    writer = module.FileSystemWriter
    original = writer.write_data
    calls = [0]

    def write_data(self, plan, planner):
        calls[0] += 1
        future = original(self, plan, planner)
        if calls[0] == CRASH_ON_CALL:
            future.wait()
            print(f"crash_in_writer: exiting inside FileSystemWriter.write_data (call {calls[0]})", flush=True)
            os._exit(9)
        return future

    writer.write_data = write_data


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())
