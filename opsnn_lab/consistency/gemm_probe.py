"""Which GEMM path gives ``strict()``'s reference bits on the running machine, probed once and cached.

``strict()`` promises that a GEMM row's bits depend on nothing but that row's operands: not on the
batch size, the row's position in the batch, nor the thread count. Its reference ("canonical") path
of each GEMM in :mod:`opsnn_lab.consistency.fixed_order` is the most conservative one: row-major
operands and, for ``mm``, one GEMM of exactly ``ROW_BLOCK`` rows per block of rows, every one run with
one thread. Faster paths keep a column-major operand uncopied, run one GEMM over all the rows, or use
the running thread count. Whether those give the reference's bits is a property of the BLAS library
and the CPU (MKL on AVX-512 gives them; MKL restricted to AVX2 splits rows over threads into panels
whose remainders take other kernels, and does not), so it is not assumed: the first time a GEMM of
a given (op, dtype, operand layouts, shape, thread count) is met, each faster path is run on random
operands of that shape and layout and compared bitwise with the reference path; the first that
matches is cached and used from then on, and if none does the reference path runs.

The reference itself is checked once per probe too: reversing the rows of a block must reverse the
rows of its result (``mm``), and a batch's first and last matrices alone must give their rows of the
whole batch (``bmm``). :func:`strict_probe_report` lists every probe with the path it chose.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings

import torch

__all__ = ["strict_probe_report", "clear_probes", "one_thread", "threads", "choose"]

FORCE_MISMATCH = False  # tests: every comparison fails, so each probe falls back to the reference path
_MAX_ENTRIES = 4096  # distinct GEMM shapes remembered; beyond that the oldest are probed again
_CACHE: dict[tuple, str] = {}
_REPORT: dict[tuple, dict] = {}
_LOCK = threading.Lock()
_GEN_SEED = 20261202


@contextlib.contextmanager
def threads(n: int):
    """Run the block with ``n`` intra-op threads (process-wide while it runs), then restore the count."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread():
    """``threads(1)``: the block on one intra-op thread."""
    return threads(1)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return not FORCE_MISMATCH and x.shape == y.shape and torch.equal(x, y)


def random_like_layout(shape, layout: str, like: torch.Tensor, generator) -> torch.Tensor:
    """Random operand of ``shape`` with ``like``'s dtype and device, stored row-major (``"row"``) or
    column-major over its last two axes (``"col"``)."""
    if layout == "col" and len(shape) >= 2:
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator)
        return t.to(device=like.device, dtype=like.dtype).transpose(-1, -2)
    return torch.randn(tuple(shape), generator=generator).to(device=like.device, dtype=like.dtype)


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(_GEN_SEED)


def choose(key: tuple, candidates, reference: str, run, reference_check=None) -> str:
    """The first of ``candidates`` whose result has the bits of ``reference`` for ``key``, else ``reference``.

    ``run(path)`` computes the probe's GEMM (on random operands built for ``key``) along ``path``;
    ``reference_check(reference_result)`` returns whether the reference path itself is row-local (see module doc).
    """
    path = _CACHE.get(key)
    if path is not None:
        return path
    with _LOCK:
        path = _CACHE.get(key)
        if path is not None:
            return path
        start = time.perf_counter()
        with torch.no_grad():
            want = run(reference)
            path = next((c for c in candidates if same_bits(run(c), want)), reference)
            local = reference_check(want) if reference_check is not None else None
        if local is False:
            warnings.warn(f"strict(): the reference GEMM path is not row-local for {key}: bit-identity "
                          "across batch sizes is not guaranteed for this shape on this machine", RuntimeWarning,
                          stacklevel=2)
        if len(_CACHE) >= _MAX_ENTRIES:
            oldest = next(iter(_CACHE))
            del _CACHE[oldest]
            _REPORT.pop(oldest, None)
        _CACHE[key] = path
        _REPORT[key] = {"key": key, "path": path, "candidates": list(candidates), "reference_row_local": local,
                        "probe_ms": round((time.perf_counter() - start) * 1e3, 3)}
        return path


def strict_probe_report() -> list[dict]:
    """Every GEMM probe of this process: its key (op, dtype, layouts, shape, threads...) and chosen path.

    ``path`` is the name of the fastest candidate that gave the reference bits, or the reference
    path's own name where none did; ``reference_row_local`` is False where the reference path itself
    was found to depend on a row's position (then bit-identity across batch sizes cannot hold);
    ``probe_ms`` is what the probe cost.
    """
    with _LOCK:
        return [dict(entry) for entry in _REPORT.values()]


def clear_probes() -> None:
    """Forget every probe (the next GEMM of each shape probes again)."""
    with _LOCK:
        _CACHE.clear()
        _REPORT.clear()
