"""fsdptrain.run.host_memory: with the mmap threshold fixed, freed tensors leave the resident set.

The scenario is the training step's: a large block is freed (glibc's dynamic threshold then rises to its size), then
many mid-size tensors are allocated between small kept ones and freed. On glibc's default they stay in the heap's
holes; with the fixed threshold each has its own mapping and is given back. Each case runs in a fresh interpreter
(the setting holds for the rest of a process).
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCENARIO = """
import os, sys
from pathlib import Path
import torch
from fsdptrain.run.host_memory import fix_mmap_threshold
rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
big = torch.ones(2**21)  # 8 MiB
del big
base = rss()
mid, kept = [], []
for _ in range(64):
    mid.append(torch.ones(2**19))  # 2 MiB each, 128 MiB in all
    kept.append(torch.ones(2**15))  # 128 KiB, kept between them
mid.clear()
print((rss() - base) / 2**20)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("mode,low,high", [("fixed", -1e9, 16), ("default", 96, 1e9)])
def test_freed_tensors_leave_the_resident_set_only_with_the_fixed_threshold(mode, low, high):
    done = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, check=True,
                          env={"PATH": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)})
    kept_mib = float(done.stdout.split()[-1])
    assert low < kept_mib < high, (mode, kept_mib)
