"""Which backend runs a kernel, and the launch settings every Triton kernel uses.

Triton runs on CUDA tensors, the torch reference everywhere else. ``OPSNN_BACKEND``
overrides: ``torch`` forces the reference, ``triton`` forces the kernels (on CPU that
needs ``TRITON_INTERPRET=1``, which is how the kernels are tested without a GPU).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["backend_for", "backend_for_device", "calculate_settings", "cdiv", "forced_backend", "triton_available"]

_MAX_BLOCK = 65536 // 4  # elements per program: 64 KiB of fp32, the most one block keeps in registers


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend_for(*tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for an op over ``tensors``."""
    for t in tensors:  # a loop, not any(generator): asked a few times per fused op, on every call
        if t is not None and t.is_cuda:
            return _choose(True)
    return _choose(False)


def backend_for_device(device) -> str:
    """``"triton"`` or ``"torch"`` for an op that makes a new tensor on ``device`` (a draw) from no tensor."""
    return _choose(torch.device(device).type == "cuda")


def forced_backend() -> str | None:
    """``"torch"`` or ``"triton"`` where ``OPSNN_BACKEND`` forces one, else None (``auto``)."""
    choice = _setting()
    return None if choice == "auto" else choice


def _setting() -> str:
    choice = os.environ.get("OPSNN_BACKEND")
    if choice is None:
        return "auto"
    choice = choice.lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"OPSNN_BACKEND must be auto, torch or triton, got {choice!r}")
    return choice


def _choose(on_cuda: bool) -> str:
    choice = _setting()
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("OPSNN_BACKEND=triton but triton is not installed (pip install opsnn-lab[triton])")
        if not on_cuda and not _interpreting():
            raise RuntimeError("OPSNN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1")
        return "triton"
    return "triton" if on_cuda and triton_available() else "torch"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for a launch grid (no triton import needed to size one)."""
    return -(-a // b)


def calculate_settings(n: int) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` for a row of ``n`` elements: next power of two, warps by size."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    block = 1 << (n - 1).bit_length()
    if block > _MAX_BLOCK:
        raise ValueError(f"row of {n} elements exceeds the largest block ({_MAX_BLOCK}); tile the row instead")
    num_warps = 4
    if block >= 32768:
        num_warps = 32
    elif block >= 8192:
        num_warps = 16
    elif block >= 2048:
        num_warps = 8
    return block, num_warps
