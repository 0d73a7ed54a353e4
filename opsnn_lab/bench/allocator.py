"""The CPU allocator a benchmark runs under, and the page faults a step takes.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves blocks over its mmap threshold
(adaptive, up to 32 MiB) with fresh ``mmap`` pages and gives the top of its heap back to the system once more
than its trim threshold is free; the next step then faults every page in again. Which variant of a
comparison pays for this depends on the order its buffers are freed, not on the work it does: on one
1x1 Conv -> BN -> Hardswish row the same code measured eager at 34 ms or 45 ms, fused at 0 or 7,000 faults
per step, from run to run. ``steady()`` fixes both thresholds (the trim threshold at 1 GiB, the mmap threshold
at its 32 MiB ceiling), as a training process under jemalloc or tcmalloc keeps its pages, so a ratio measures
the ops. Every variant of a run shares it, and the bench JSON records which allocator ran
(``"allocator"``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["steady", "page_faults"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_TRIM, _MMAP = 1 << 30, 32 << 20


def steady() -> str:
    """Keep freed memory in the process (glibc); returns what the run's allocator is, for the JSON."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"system (no glibc mallopt: {name or 'no C library found'})"
    if mallopt(_M_TRIM_THRESHOLD, _TRIM) != 1 or mallopt(_M_MMAP_THRESHOLD, _MMAP) != 1:
        return "system (mallopt refused the thresholds)"
    return "steady (glibc: trim threshold 1 GiB, mmap threshold 32 MiB)"


def page_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
