"""Per-tensor statistics and the bitwise hash the tracer records for every op output.

Cheap by construction (a handful of reductions per tensor, no float64 copy): this runs on every op of a
traced step, so it is most of what ``trace()`` costs on top of the step itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TensorStats", "summarize", "tensor_hash", "stats_from_dict"]

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass
class TensorStats:
    """Summary of one tensor: what two runs exchange before (or instead of) the tensor itself."""

    shape: tuple
    dtype: str
    min: float
    max: float
    mean: float
    std: float
    norm: float
    nan: int
    inf: int
    hash: str

    def as_dict(self) -> dict:
        return {k: (list(v) if k == "shape" else v) for k, v in self.__dict__.items()}


def stats_from_dict(d: dict) -> TensorStats:
    return TensorStats(**{**d, "shape": tuple(d["shape"])})


_weights: dict[tuple, torch.Tensor] = {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.reshape(-1).view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t).reshape(-1).view(_BITS[t.element_size() // 2])
    return t.reshape(-1).view(_BITS[t.element_size()])


def _hash_parts(t: torch.Tensor) -> list[int]:
    bits = _bits(t)
    n = bits.numel()
    key = (n, bits.device)
    w = _weights.get(key)
    if w is None:
        # odd int32 multipliers: multiplying by an odd number is a bijection mod 2**32, so changing any
        # one element changes its product and the sum; position-dependent, so a permutation shows too
        w = (torch.arange(1, n + 1, dtype=torch.int64, device=bits.device) * 0x9E3779B1 + 0x7F4A7C15)
        w = ((w & 0x7FFFFFFF) | 1).to(torch.int32)
        if len(_weights) > 256:
            _weights.clear()
        _weights[key] = w
    # int32 products and int32 sums wrap: exact arithmetic mod 2**32, the same on any machine and in any
    # reduction order (a native int32 sum is ~6x faster than the int64-promoting default)
    return torch.stack([(bits * w).sum(dtype=torch.int32), bits.sum(dtype=torch.int32)]).tolist()


def _hex(h: list[int]) -> str:
    return f"{h[0] & 0xFFFFFFFF:08x}{h[1] & 0xFFFFFFFF:08x}"


def tensor_hash(t: torch.Tensor) -> str:
    """Bitwise hash: the raw bits as integers times position weights, summed (one pass, no float math)."""
    return _hex(_hash_parts(t.detach()))


def summarize(t: torch.Tensor) -> TensorStats:
    """Shape, dtype, min/max/mean/std/norm and NaN/Inf counts plus the bitwise hash.

    Four passes over the tensor, no float64 copy of it: the hash, sum, norm and aminmax. Statistics
    accumulate in float32 (float64 for float64 tensors): they are for people to read, the errors that
    judge a divergence are computed elementwise in float64.
    """
    t = t.detach()
    shape, dtype = tuple(t.shape), str(t.dtype).replace("torch.", "")
    n = t.numel()
    h = _hex(_hash_parts(t))
    if n == 0:
        return TensorStats(shape, dtype, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, h)
    x = t.abs() if t.is_complex() else t
    if not x.dtype.is_floating_point:
        x = x.to(torch.float64)
    elif x.element_size() < 4:
        x = x.float()
    nan = inf = 0
    s, nrm = torch.stack([x.sum(), torch.linalg.vector_norm(x)]).tolist()
    if not (math.isfinite(s) and math.isfinite(nrm)):
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        x = x[torch.isfinite(x)]
        n = x.numel()
        if n == 0:
            return TensorStats(shape, dtype, math.nan, math.nan, math.nan, math.nan, math.nan, nan, inf, h)
        s, nrm = torch.stack([x.sum(), torch.linalg.vector_norm(x)]).tolist()
    mn, mx = torch.stack(torch.aminmax(x.reshape(-1))).tolist()
    mean = s / n
    var = max(nrm * nrm / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 0.0)
    return TensorStats(shape, dtype, float(mn), float(mx), mean, math.sqrt(var), nrm, nan, inf, h)
