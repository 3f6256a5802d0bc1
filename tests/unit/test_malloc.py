"""fsdptrain/run/malloc.py: after `keep_freed_heap`, what a step frees stays resident for the next step.

Each case runs in a fresh interpreter: ``mallopt`` changes the whole process, for good.
"""

import subprocess
import sys

import pytest

# A "step": ten 10 MiB blocks (under the 32 MiB mmap threshold) written, then freed, last first (they merge into
# the heap's free top); the minor page faults of the second step. 100 MiB is 25600 pages of 4 KiB.
SECOND_STEP_FAULTS = """
import ctypes, resource, sys
from fsdptrain.run.malloc import keep_freed_heap
took = keep_freed_heap() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def step():
    blocks = [libc.malloc(10 * 2**20) for _ in range(10)]
    for block in blocks:
        libc.memset(block, 1, 10 * 2**20)
    for block in reversed(blocks):
        libc.free(block)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_step_faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SECOND_STEP_FAULTS, mode], capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, Linux page-fault counts")
def test_freed_heap_stays_resident_for_the_next_step():
    took, faults = second_step_faults("keep")
    assert took == "True"
    assert faults < 1000  # the first step's pages, reused
    took, faults = second_step_faults("default")  # glibc's default hands them back: the step faults them in again
    assert took == "None"
    assert faults > 20000
