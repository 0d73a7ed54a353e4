"""MemoryPool on CPU: buffers are reused by size class, stats add up, bad arguments rejected."""

from __future__ import annotations

import gc

import pytest
import torch

from opsnn_lab import memory
from opsnn_lab.memory import MemoryPool, _size_class


def test_size_classes_waste_at_most_a_quarter():
    for n in [1, 511, 512, 513, 1000, 4097, 10**6 + 3]:
        c = _size_class(n, 512)
        assert c >= n and c - n < max(n / 4, 512)


def test_buffers_are_reused_after_release():
    with MemoryPool("cpu") as pool:
        a = pool.empty((100, 10), torch.float32)
        a.fill_(1.0)
        ptr = a.data_ptr()
        del a
        gc.collect()
        b = pool.empty((1000,), torch.float32)  # same 4000-byte request, same class
        assert b.data_ptr() == ptr and b.shape == (1000,)
        s = pool.stats()
        assert (s.allocations, s.allocations_avoided) == (2, 1)
        assert s.in_use_bytes == 4000 and s.reserved_bytes == _size_class(4000, 512)


def test_live_buffers_are_never_shared():
    with MemoryPool("cpu") as pool:
        ts = [pool.empty((64,), torch.float32) for _ in range(8)]
        for i, t in enumerate(ts):
            t.fill_(i)
        assert all(float(t[0]) == i for i, t in enumerate(ts))
        assert len({t.data_ptr() for t in ts}) == 8


def test_module_level_empty_uses_innermost_pool():
    outer, inner = MemoryPool("cpu"), MemoryPool("cpu")
    assert memory.current_pool() is None
    with outer:
        with inner:
            memory.empty((10,), torch.float16)
        memory.empty((10,), torch.float16)
    assert inner.stats().allocations == 1 and outer.stats().allocations == 1
    assert memory.empty((3,)).shape == (3,)  # no pool: plain torch.empty


def test_fragmentation_and_peak():
    with MemoryPool("cpu") as pool:
        keep = [pool.empty((1000,), torch.uint8) for _ in range(4)]  # class 1024: 24 bytes waste each
        s = pool.stats()
        assert s.peak_reserved_bytes == 4096 and s.peak_in_use_bytes == 4000
        assert s.fragmentation == pytest.approx(1 - 4000 / 4096)
        del keep
        gc.collect()
        assert pool.stats().in_use_bytes == 0 and pool.stats().reserved_bytes == 4096
        pool.empty_cache()
        assert pool.stats().reserved_bytes == 0


def test_cache_limit_returns_blocks():
    with MemoryPool("cpu", max_cached_bytes=0) as pool:
        t = pool.empty((256,), torch.float32)
        del t
        gc.collect()
        assert pool.stats().reserved_bytes == 0


def test_empty_tensor_and_dtypes():
    with MemoryPool("cpu") as pool:
        assert pool.empty((0, 5)).shape == (0, 5)
        assert pool.empty((3,), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, err, word", [
    (dict(device="meta"), ValueError, "device"),
    (dict(granularity=0), ValueError, "granularity"),
    (dict(max_cached_bytes=-1), ValueError, "max_cached_bytes"),
    (dict(expandable_segments="yes"), TypeError, "expandable_segments"),
])
def test_bad_arguments(kwargs, err, word):
    with pytest.raises(err, match=word):
        MemoryPool(**kwargs)


def test_negative_shape_rejected():
    with pytest.raises(ValueError, match="shape"):
        MemoryPool("cpu").empty((-1, 2))


@pytest.mark.gpu
def test_cuda_pool_reports_fragmentation():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with MemoryPool("cuda") as pool:
        xs = [torch.empty(n * 1024, device="cuda") for n in (3, 7, 11, 5)]
        del xs
    s = pool.stats()
    assert s.peak_reserved_bytes >= s.peak_in_use_bytes > 0 and 0.0 <= s.fragmentation < 1.0
