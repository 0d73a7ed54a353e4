"""Fused ops under ``torch.autocast``: compute what autocast computes, with autocast off inside.

Autocast casts the operands of matmuls and convolutions (``linear``, ``conv``, ``addmm``, SDPA) to its dtype
and leaves elementwise ops and BatchNorm in their input's dtype. An op module inside an autocast region does
the same by hand, once, before its autograd Function: ``region(x)`` switches autocast off for ``x``'s device
and gives the cast for the op's matmul operands (its input, its Linear/Conv weights and biases; never norm
parameters or running statistics). The casts are ordinary differentiable ``.to`` calls, so gradients reach
fp32 parameters in fp32, as under autocast. Autocast off inside keeps the op's own fp32 statistics and
accumulations in fp32 (autocast would cast an fp32 GEMM inside a Function down to bf16).

``no_autocast`` wraps a Function's ``forward``/``backward``: a backward called inside an autocast region
(``loss.backward()`` under ``with torch.autocast(...)``) then runs in its saved tensors' dtypes as well.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

__all__ = ["autocast_dtype", "region", "no_autocast"]


def _any_autocast_fallback() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda", "xpu", "mps"))


# one query of every device's autocast state (0.1 us): most calls are made with autocast off, and every fused op
# asks two or three times a step
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast_fallback)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs a matmul on ``x`` in, or None when autocast is off for ``x``'s device (or ``x`` is
    not a tensor: the op's own checks then name it)."""
    if not _any_autocast() or not isinstance(x, torch.Tensor):
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _caster(dtype: torch.dtype, device: str) -> Callable[..., tuple]:
    def cast(*tensors):  # autocast's eligibility: floating, on the region's device, not float64
        return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == device
                     and t.dtype is not torch.float64 else t for t in tensors)
    return cast


def _same(*tensors) -> tuple:
    return tensors


class _Off:
    """The region outside autocast: nothing to cast, nothing to switch; one shared object (a generator-based
    context manager costs ~1.5 us a call, and every fused op enters a region)."""

    def __enter__(self) -> Callable[..., tuple]:
        return _same

    def __exit__(self, *exc) -> None:
        return None


_OFF = _Off()


@contextlib.contextmanager
def _autocast_off(device: str, dtype: torch.dtype) -> Iterator[Callable[..., tuple]]:
    with torch.autocast(device, enabled=False):
        yield _caster(dtype, device)


def region(x: torch.Tensor) -> contextlib.AbstractContextManager[Callable[..., tuple]]:
    """``with region(x) as cast: x, w, b = cast(x, weight, bias)``: autocast's matmul casts, autocast off."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return _OFF
    return _autocast_off(x.device.type, dtype)


def _device_of(args) -> str | None:
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)


def no_autocast(method: Callable) -> Callable:
    """Run a Function's static ``forward(ctx, ...)`` / ``backward(ctx, ...)`` with autocast off."""

    @functools.wraps(method)
    def run(ctx, *args):
        if not _any_autocast():
            return method(ctx, *args)
        device = _device_of(args)
        if device is None or not torch.is_autocast_enabled(device):
            return method(ctx, *args)
        with torch.autocast(device, enabled=False):
            return method(ctx, *args)

    return run
