"""``MemoryPool``: the seed's ``memory_pool`` interface, measured honestly.

* **CUDA**: the pool enters a private ``torch.cuda.MemPool`` (so a training region's blocks
  do not interleave with everything else's) and can switch the caching allocator to
  expandable segments for its duration, the setting that removes most fragmentation
  under variable sequence lengths. Fragmentation is read from ``torch.cuda.memory_stats``
  as ``1 - allocated / reserved`` at peak.
* **CPU**: the pool is a size-class cache for workspace and saved-tensor buffers requested
  through ``pool.empty(...)`` (the fused ops and ``opsnn_lab.bench`` use it through
  ``opsnn_lab.memory.empty``). A buffer goes back to its class when the tensor handed out
  is garbage collected, and the next request of that class reuses it without asking the
  system allocator. ``stats()`` counts reserved and in-use bytes, the peak, the
  fragmentation (rounding waste + cached free blocks over reserved, at peak) and the
  allocations avoided.

``with MemoryPool() as pool: ...; pool.stats()``. Pools nest; ``empty()`` outside any pool
is plain ``torch.empty``.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from opsnn_lab._checks import check_positive, check_type

__all__ = ["MemoryPool", "PoolStats", "empty", "current_pool"]

_local = threading.local()


def current_pool() -> MemoryPool | None:
    stack = getattr(_local, "stack", [])
    return stack[-1] if stack else None


def empty(shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """A workspace tensor from the innermost active CPU pool, else ``torch.empty``."""
    pool = current_pool()
    if pool is not None and torch.device(device).type == "cpu" and pool.device.type == "cpu":
        return pool.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class PoolStats:
    device: str
    reserved_bytes: int
    in_use_bytes: int
    peak_reserved_bytes: int
    peak_in_use_bytes: int
    fragmentation: float          # 1 - in_use / reserved, at the reserved peak
    allocations: int              # requests served
    allocations_avoided: int      # requests served from cached blocks (no system allocation)

    def to_dict(self) -> dict:
        return asdict(self)

    def _repr_html_(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"
        return (f"<b>MemoryPool</b> ({self.device}): reserved {mib(self.reserved_bytes)}, in use "
                f"{mib(self.in_use_bytes)}, peak {mib(self.peak_reserved_bytes)}, fragmentation "
                f"{self.fragmentation:.1%}, {self.allocations_avoided}/{self.allocations} allocations avoided")


def _size_class(nbytes: int, granularity: int) -> int:
    """Round up to the next of 4 steps per power of two (at most 25% waste), at least ``granularity``."""
    if nbytes <= granularity:
        return granularity
    top = 1 << (nbytes - 1).bit_length()
    step = max(top // 8, granularity)
    return -(-nbytes // step) * step


class MemoryPool:
    """A memory pool for a training region; see the module docstring for what it does per device."""

    def __init__(self, device: str | torch.device | None = None, *, granularity: int = 512,
                 max_cached_bytes: int | None = None, expandable_segments: bool = True):
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is cuda but CUDA is not available")
        check_positive("granularity", granularity, integer=True)
        if max_cached_bytes is not None:
            check_positive("max_cached_bytes", max_cached_bytes, allow_zero=True, integer=True)
        check_type("expandable_segments", expandable_segments, bool)
        self.device = device
        self.granularity = granularity
        self.max_cached_bytes = max_cached_bytes
        self.expandable_segments = expandable_segments
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self._reserved = self._in_use = self._in_use_requested = 0
        self._peak_reserved = self._peak_in_use = 0
        self._frag_at_peak = 0.0
        self._allocations = self._avoided = 0
        self._cuda_pool = self._cuda_ctx = None
        self._cuda_base: dict | None = None

    # ----------------------------------------------------------------- context
    def __enter__(self) -> MemoryPool:
        if self.device.type == "cuda":
            self._enter_cuda()
        _local.stack = [*getattr(_local, "stack", []), self]
        return self

    def __exit__(self, *exc) -> None:
        _local.stack = [p for p in getattr(_local, "stack", []) if p is not self]
        if self.device.type == "cuda":
            self._exit_cuda()

    def _enter_cuda(self) -> None:
        if self.expandable_segments:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        self._cuda_pool = torch.cuda.MemPool()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._cuda_ctx = torch.cuda.use_mem_pool(self._cuda_pool, device=index)  # "cuda" alone is refused
        self._cuda_ctx.__enter__()
        torch.cuda.reset_peak_memory_stats(self.device)

    def _exit_cuda(self) -> None:
        self._cuda_base = torch.cuda.memory_stats(self.device)
        self._cuda_ctx.__exit__(None, None, None)
        if self.expandable_segments:
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")

    # ----------------------------------------------------------------- CPU allocator
    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised CPU tensor whose buffer comes from (and returns to) this pool."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        shape = torch.Size(shape if not isinstance(shape, int) else (shape,))
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative, got {tuple(shape)}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = shape.numel() * itemsize
        cls = _size_class(max(nbytes, 1), self.granularity)
        with self._lock:
            self._allocations += 1
            blocks = self._free.get(cls)
            if blocks:
                block = blocks.pop()
                self._avoided += 1
            else:
                block = torch.empty(cls, dtype=torch.uint8)
                self._reserved += cls
            self._in_use += cls
            self._in_use_requested += nbytes
            self._update_peaks()
        out = block[:nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        weakref.finalize(out, self._release, cls, nbytes, block)
        return out

    def _release(self, cls: int, nbytes: int, block: torch.Tensor) -> None:
        with self._lock:
            self._in_use -= cls
            self._in_use_requested -= nbytes
            cached = self._reserved - self._in_use
            if self.max_cached_bytes is not None and cached > self.max_cached_bytes:
                self._reserved -= cls  # drop the block: the system allocator takes it back
            else:
                self._free[cls].append(block)

    def _update_peaks(self) -> None:
        self._peak_in_use = max(self._peak_in_use, self._in_use_requested)
        if self._reserved >= self._peak_reserved:
            self._peak_reserved = self._reserved
            self._frag_at_peak = 1.0 - self._in_use_requested / self._reserved if self._reserved else 0.0

    def empty_cache(self) -> None:
        """Return every cached free block to the system allocator."""
        with self._lock:
            for cls, blocks in self._free.items():
                self._reserved -= cls * len(blocks)
            self._free.clear()

    # ----------------------------------------------------------------- stats
    def stats(self) -> PoolStats:
        if self.device.type == "cuda":
            s = self._cuda_base if self._cuda_base is not None else torch.cuda.memory_stats(self.device)
            peak_res, peak_alloc = s.get("reserved_bytes.all.peak", 0), s.get("allocated_bytes.all.peak", 0)
            return PoolStats(str(self.device), s.get("reserved_bytes.all.current", 0),
                             s.get("allocated_bytes.all.current", 0), peak_res, peak_alloc,
                             1.0 - peak_alloc / peak_res if peak_res else 0.0,
                             s.get("allocation.all.allocated", 0),
                             s.get("allocation.all.allocated", 0) - s.get("segment.all.allocated", 0))
        with self._lock:
            return PoolStats(str(self.device), self._reserved, self._in_use_requested, self._peak_reserved,
                             self._peak_in_use, self._frag_at_peak, self._allocations, self._avoided)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"MemoryPool(device={s.device}, reserved={s.reserved_bytes}, in_use={s.in_use_bytes}, "
                f"fragmentation={s.fragmentation:.3f}, avoided={s.allocations_avoided}/{s.allocations})")
