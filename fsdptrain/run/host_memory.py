"""Host memory given back to the system when a CPU run frees its tensors: glibc malloc with a fixed mmap threshold.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB by default) with a mapping of its own,
unmapped when freed. The default threshold is dynamic: freeing such a block raises it to the block's size, up to
32 MiB. After the first training step frees its activations, every tensor up to 32 MiB (all of a 135 M model's
activations, gradients and weights) then comes from the heap, which fragments and is kept by the process: on
`fsdptrain sft` of SmolLM2-135M the resident set at a step's end grew from 3.1 to 4.4 GiB between the first and the
second step and stayed there, 2.3 GiB above what the live tensors (weights, AdamW's moments) need. Fixing the
threshold at glibc's own default (`mallopt(M_MMAP_THRESHOLD)`, which also turns the dynamic adjustment off) keeps
large tensors in their own mappings, so the resident set follows the live tensors (docs/performance.md, the
`sft_compare` section). The cost is the page faults of a fresh mapping per large allocation, small beside a step's
matmuls; the rollout engines, which allocate per decoded token, are left on glibc's default.

Only where the C library is glibc; elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold(num_bytes: int = GLIBC_DEFAULT_MMAP_THRESHOLD) -> bool:
    """Serve every allocation of at least ``num_bytes`` from its own mapping, for the rest of the process; whether
    glibc took the setting (False where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(num_bytes)))
