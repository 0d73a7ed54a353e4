"""Per-tensor power-of-two scaling into fp16/bf16: the seed's local-scaling stage.

``scale = 2**ceil(log2(amax * world_size / dtype_max))`` and ``grad_low = (grad / scale).to(dtype)``
(seed section 4, stage 1, with headroom for the ``world_size`` ranks an all-reduce will sum). The
scale is a power of two, so dividing by it only moves exponents: ``grad_low.float() * scale`` gives
back every value that the target dtype can hold, bit for bit. A small gradient (amax 1e-9) gets a
scale below one and is lifted into fp16's normal range instead of flushing to zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from opsnn_lab._checks import check_choice, check_positive, check_tensor

__all__ = ["FP16_MAX", "FP16_MIN", "FP16_TINY", "BF16_MAX", "LocalScaler", "CastReport", "NonFiniteGradientError",
           "pow2_scale", "flush_fraction", "amax_of", "tensor_amaxes", "stored"]

FP16_MAX = 65504.0                 # largest finite fp16
FP16_MIN = 2.0**-14                # smallest normal fp16 (6.1e-5): below it precision is lost
FP16_TINY = 2.0**-24               # smallest subnormal fp16: below half of it a value flushes to zero
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_LOW_DTYPES = (torch.float16, torch.bfloat16)
# |x| <= this rounds to zero when cast (round-to-nearest-even: half the smallest subnormal ties to 0).
_FLUSH = {torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}


class NonFiniteGradientError(FloatingPointError):
    """A gradient handed to a scaler held NaN or Inf; casting it would hide the fault."""


def pow2_scale(amax: float, dtype_max: float = FP16_MAX, world_size: int = 1) -> float:
    """Smallest power of two ``s`` with ``amax * world_size / s <= dtype_max`` (1.0 for amax 0).

    Computed on exponents (``math.frexp``/``ldexp``), not with a rounded ``log2``, so the bound holds
    exactly at the edges (amax = 65504 gives 1.0, amax = 65505 gives 2.0).
    """
    if not math.isfinite(amax):
        raise NonFiniteGradientError(f"amax must be finite to choose a scale, got {amax}")
    need = float(amax) * world_size
    if need <= 0.0:
        return 1.0
    _, e = math.frexp(need / dtype_max)
    k = e  # need / dtype_max < 2**e
    while k > -1100 and need <= math.ldexp(dtype_max, k - 1):
        k -= 1
    while need > math.ldexp(dtype_max, k):
        k += 1
    return math.ldexp(1.0, k)


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stored(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` stores: a sparse gradient's (``nn.Embedding(sparse=True)``), coalesced so that an index
    given twice counts as its sum; a dense tensor itself."""
    if t.layout == torch.sparse_coo:
        return t.coalesce()._values()
    return t.values() if t.layout in _COMPRESSED else t


def tensor_amaxes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """max |x| of each (non-empty) tensor as one fp32 vector; NaN propagates, Inf shows as Inf.

    One ``aminmax`` pass per tensor: on CPU that is ~50x faster than ``_foreach_norm(ts, inf)`` and,
    unlike ``abs().max()``, allocates nothing of the tensor's size.
    """
    mins, maxs = zip(*(torch.aminmax(stored(t).detach()) for t in tensors))
    return torch.maximum(torch.stack(maxs).float(), torch.stack(mins).float().neg())


def amax_of(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """max |x| over all ``tensors`` as a 0-d fp32 tensor (NaN if any holds NaN; 0 if all are empty)."""
    ts = [t for t in tensors if stored(t).numel()]
    if not ts:
        return torch.zeros(())
    return tensor_amaxes(ts).max()


def flush_fraction(tensors: Iterable[torch.Tensor] | torch.Tensor, scale: float = 1.0,
                   dtype: torch.dtype = torch.float16) -> float:
    """Fraction of elements that are non-zero but become zero when ``x * scale`` is cast to ``dtype``.

    This is silent underflow: the cast raises no error, the gradient just disappears. Tensors already
    in ``dtype`` have flushed before they got here and count as 0.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    thr = _FLUSH[dtype] / scale
    flushed = total = 0
    for t in map(stored, tensors):
        total += t.numel()
        if t.numel() == 0 or t.dtype == dtype:
            continue
        a = t.detach().abs()
        flushed += int(torch.count_nonzero(a <= thr)) - int(torch.count_nonzero(a == 0))
    return flushed / total if total else 0.0


@dataclass
class CastReport:
    """What the last ``cast`` did: amax in, scale chosen, non-finite and flushed element counts."""

    amax: float
    scale: float
    nan: int = 0
    inf: int = 0
    flushed: int = 0
    numel: int = 0

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0


def _mul_pow2(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * 2**k`` exactly, in steps that keep every factor a normal fp32 number."""
    out = x
    while k != 0:
        step = max(-126, min(127, k))
        out = out * math.ldexp(1.0, step)
        k -= step
    return out


class LocalScaler:
    """Cast a gradient to fp16/bf16 with its own power-of-two scale.

    ``LocalScaler(dtype=torch.float16, world_size=1)``. ``cast(grad) -> (grad_low, scale)`` with
    ``grad ~= grad_low.float() * scale``; ``world_size`` ranks of such tensors can be summed in
    ``dtype`` without overflow. ``nonfinite="raise"`` (default) raises ``NonFiniteGradientError`` on
    NaN/Inf; ``"keep"`` passes them through unscaled (scale 1.0) so a later finite check sees them.
    ``last_report`` tells what happened either way.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, world_size: int = 1, nonfinite: str = "raise"):
        check_choice("dtype", dtype, _LOW_DTYPES)
        check_positive("world_size", world_size, integer=True)
        check_choice("nonfinite", nonfinite, ("raise", "keep"))
        self.dtype = dtype
        self.world_size = world_size
        self.nonfinite = nonfinite
        self.dtype_max = FP16_MAX if dtype == torch.float16 else BF16_MAX
        self.last_report: CastReport | None = None

    def scale_for(self, amax: float) -> float:
        return pow2_scale(amax, self.dtype_max, self.world_size)

    def cast(self, grad: torch.Tensor) -> tuple[torch.Tensor, float]:
        check_tensor("grad", grad, dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16))
        n = grad.numel()
        if n == 0:
            self.last_report = CastReport(0.0, 1.0)
            return grad.to(self.dtype), 1.0
        amax = float(amax_of([grad]))
        if not math.isfinite(amax):
            nan = int(torch.isnan(grad).sum())
            inf = int(torch.isinf(grad).sum())
            self.last_report = CastReport(amax, 1.0, nan=nan, inf=inf, numel=n)
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(f"grad holds {nan} NaN and {inf} Inf values out of {n}; "
                                             "fix the source or pass nonfinite='keep' to let a finite check skip it")
            return grad.to(self.dtype), 1.0
        scale = self.scale_for(amax)
        k = -int(math.log2(scale))  # exact: scale is a power of two
        low = _mul_pow2(grad.float() if grad.dtype != torch.float64 else grad, k).to(self.dtype)
        flushed = int(torch.count_nonzero((low == 0) & (grad != 0)))
        self.last_report = CastReport(amax, scale, flushed=flushed, numel=n)
        return low, scale

    def unscale(self, grad_low: torch.Tensor, scale: float) -> torch.Tensor:
        """``grad_low.float() * scale``: the fp32 gradient back, exact for a power-of-two scale."""
        check_tensor("grad_low", grad_low)
        check_positive("scale", scale)
        return _mul_pow2(grad_low.float(), int(math.log2(scale)))

    def __repr__(self) -> str:
        return f"LocalScaler(dtype={self.dtype}, world_size={self.world_size}, nonfinite={self.nonfinite!r})"
