"""Keeping freed memory in the process instead of giving it back to the kernel every step.

glibc's malloc serves a large request (above its mmap threshold, which adapts up to 32 MiB) with a
fresh mmap and unmaps it when freed, and trims the heap's free top back to the kernel. A training
step frees and re-allocates the same activations, gradients and transfer buffers every step, so
every step touches fresh pages: one page fault per 4 KiB, and a fresh tensor costs many times a
copy into an existing one. On a board that pays for every page fault out of the same slice of a
core as its training, that cost is taken from compute (one core's gain: docs/benchmarks.md#dp).

`keep_freed_memory()` raises both thresholds (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD) so
that memory, once the first steps touched it, stays mapped: the process's resident memory stays
at its peak (which every step reaches anyway) instead of dropping between steps. Without glibc
(musl, macOS) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30
"""Requests below this are served from the heap, and a free top below this is not trimmed."""


def keep_freed_memory(keep_bytes: int = KEEP_BYTES) -> bool:
    """Make glibc malloc keep freed memory for reuse; False (and nothing changed) without glibc
    or when glibc refuses a setting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.info("[Allocator] not glibc: freed memory goes back to the system as its allocator decides")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, keep_bytes) and mallopt(M_TRIM_THRESHOLD, keep_bytes)):
        logger.info("[Allocator] glibc %s refused the thresholds; its defaults stay", version)
        return False
    logger.debug("[Allocator] glibc %s keeps freed memory (mmap and trim thresholds %d MiB)",
                 version, keep_bytes >> 20)
    return True
