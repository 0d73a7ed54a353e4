"""The CPU allocator a benchmark runs under, and the page faults a step takes.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves blocks over its mmap threshold
(adaptive, at most 32 MiB) with fresh ``mmap`` pages and gives the top of its heap back to the system once more
than its trim threshold is free; the next step then faults every page in again. Which variant of a
comparison pays for this depends on the order its buffers are freed and on how large they are, not on the
work it does: on one 1x1 Conv -> BN -> Hardswish row the same code measured eager at 34 ms or 45 ms, fused at
0 or 7,000 faults per step, from run to run; the eager vocabulary head + cross-entropy, whose 256 MB logits
and softmax are mmap blocks, faulted ~270,000 pages a step (a minor fault costs ~2-10 us on a KVM guest).

``steady()`` keeps freed memory in the process, as a training process under jemalloc or tcmalloc keeps its
pages: every block comes from the heap (no mmap blocks) and the heap is never trimmed (a 1 GiB trim threshold
gave the top back after every step whose frees exceeded it: the head + cross-entropy's did).
``prefault(nbytes)`` then touches one free block that large, so the heap's top is resident: glibc's free lists
fragment differently under each variant, and without headroom a step now and then grows the heap by a whole
tensor and pays its faults (one 14 MB buffer every ~10 interleaved steps of a depthwise-conv row, ~10 ms
of a 40 ms step). The block is one piece because the free memory is scattered: after two eager steps of the
head + cross-entropy (peak 750 MB) the heap held 1.7 GB free in 23 blocks, none of which fit its 262 MB
buffers; 16 MB pieces were served from those blocks and the next step faulted 192,000 pages anyway. Every
variant of a run shares both, and the bench JSON records which allocator ran (``"allocator"``) and each row's
headroom."""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["steady", "prefault", "page_faults"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
_NEVER = -1  # M_TRIM_THRESHOLD -1: the heap's top is never given back
_BLOCK = 16 << 20  # prefault's unit where one block of the whole size cannot be had


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        _ = libc.mallopt, libc.malloc, libc.free  # mallopt: glibc's (AttributeError elsewhere)
    except (OSError, AttributeError, TypeError):
        return None, name
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc, name


def steady() -> str:
    """Keep freed memory in the process (glibc); returns what the run's allocator is, for the JSON."""
    libc, name = _libc()
    if libc is None:
        return f"system (no glibc mallopt: {name or 'no C library found'})"
    if libc.mallopt(_M_TRIM_THRESHOLD, _NEVER) != 1 or libc.mallopt(_M_MMAP_MAX, 0) != 1:
        return "system (mallopt refused the settings)"
    return "steady (glibc: every block from the heap, never trimmed)"


def prefault(nbytes: int) -> int:
    """Touch ``nbytes`` of free heap and free it again, so that much headroom is resident; returns the bytes
    touched (0 without glibc). Meant after :func:`steady`, under which the freed blocks stay in the heap."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    libc, _ = _libc()
    if libc is None:
        return 0
    if nbytes == 0:
        return 0
    # One block: the heap's free blocks are scattered between live ones, and a request they cannot hold
    # grows the top. Small pieces would be served from those blocks (resident already) and leave the top
    # as it was; one block of nbytes makes a contiguous top that large. Pieces only where that fails.
    ptr = libc.malloc(nbytes)
    if ptr:
        try:
            ctypes.memset(ptr, 0, nbytes)
        finally:
            libc.free(ptr)
        return nbytes
    blocks = []
    try:
        for _ in range(-(-nbytes // _BLOCK)):
            ptr = libc.malloc(_BLOCK)
            if not ptr:
                break
            blocks.append(ptr)
            ctypes.memset(ptr, 0, _BLOCK)
    finally:
        for ptr in blocks:
            libc.free(ptr)
    return len(blocks) * _BLOCK


def page_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
