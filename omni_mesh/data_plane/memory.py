"""Process memory tuning for the data path.

glibc serves allocations above its mmap threshold (at most 32 MiB when it adapts by itself)
with fresh mappings that are unmapped on free: every large body or payload then page-faults on
its first write, at about a tenth of memcpy speed. Raising the thresholds keeps such buffers
in the heap and reuses their pages (the process keeps its peak working set, as allocators such
as jemalloc do).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = 512 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds; False (and nothing changed) elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("mallopt not available: leaving the allocator as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    logger.debug("malloc thresholds raised: %s", ok)
    return ok
