"""Per-tensor statistics and the bitwise hash the tracer records for every op output.

Cheap by construction (a handful of reductions per tensor, no float64 copy; small tensors summarised
together by ``summarize_many``): this runs on every op of a traced step, so it is most of what
``trace()`` costs on top of the step itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from opsnn_lab.consistency.gemm_probe import one_thread

__all__ = ["TensorStats", "summarize", "summarize_many", "hash_many", "tensor_hash", "stats_from_dict",
           "dtype_name"]

# 8-byte elements hash as two int32 words each: an int64 product summed as int32 would drop the upper
# half (sign, exponent and high mantissa of a float64)
_BITS = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


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
        d = dict(self.__dict__)  # every report row converts two of these: no per-field Python loop
        d["shape"] = list(self.shape)
        return d


def dtype_name(t: torch.Tensor) -> str:
    """``t``'s dtype as ``TensorStats.dtype`` spells it: ``"float32"``."""
    return str(t.dtype).replace("torch.", "")


def stats_from_dict(d: dict) -> TensorStats:
    return TensorStats(**{**d, "shape": tuple(d["shape"])})


_weights: dict[tuple, torch.Tensor] = {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()  # in logical order, and a flat view may change the element size
    if t.dtype == torch.bool:
        return t.reshape(-1).view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t).reshape(-1).view(_BITS[t.element_size() // 2])
    return t.reshape(-1).view(_BITS[t.element_size()])


_K = 1024  # row length of the hash's weight grid: element i has weight u[i // _K] * v[i % _K]
_grid: dict = {}


def _odd(n: int, mul: int, add: int, device) -> torch.Tensor:
    w = torch.arange(n, dtype=torch.int64, device=device) * mul + add
    return ((w & 0x7FFFFFFF) | 1).to(torch.int32)


def _uv(rows: int, device) -> tuple[torch.Tensor, ...]:
    """Row weights ``u`` (at least ``rows`` of them), the ``_K`` column weights ``v``, odd int32, and for the
    GEMM hash ``[v; 1]`` ([2, _K]) and ``[u, 1]`` ([len(u), 2]); cached per device."""
    hit = _grid.get(device)
    if hit is None or hit[0].numel() < rows:
        size = max(rows, 2 * hit[0].numel() if hit is not None else 64)
        u, v = _odd(size, 0x9E3779B1, 0x7F4A7C15, device), _odd(_K, 0x85EBCA6B, 0x2545F491, device)
        hit = _grid[device] = (u, v, torch.stack([v, torch.ones_like(v)]), torch.stack([u, torch.ones_like(u)], 1))
    return hit


def _spelled(n: int, device) -> torch.Tensor:
    # odd int32 multipliers (a product of odd numbers is odd): multiplying by an odd number is a
    # bijection mod 2**32, so changing any one element changes its product and the sum; the weight
    # depends on the position (row and column of the grid), so a permutation shows too
    rows = -(-n // _K)
    u, v = _uv(rows, device)[:2]
    return (u[:rows].view(-1, 1) * v.view(1, -1)).reshape(-1)[:n]  # int32 products wrap mod 2**32


def _weights_for(n: int, device) -> torch.Tensor:
    """The weights of positions ``0..n-1`` spelled out (small tensors and the elementwise path)."""
    key = (n, device)
    w = _weights.get(key)
    if w is None:
        if len(_weights) > 256:
            _weights.clear()
        w = _weights[key] = _spelled(n, device)
    return w


# A transposed (or otherwise permuted) dense tensor, such as the ``W.t()`` a Linear hands its GEMM, is
# hashed where it lies: its bits in memory order times its logical positions' weights in that order,
# cached per layout (a step meets the same ones again). Its contiguous copy is a cache-hostile
# transposition, 4-5x the hash's own cost. Up to _PERMUTED_MAX elements per tensor and _PERMUTED_BUDGET
# cached in all; beyond, the copy.
_PERMUTED_MAX = 1 << 22
_PERMUTED_BUDGET = 1 << 24
_permuted: dict[tuple, torch.Tensor] = {}


def _dense_order(t: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """``(t, None)`` for a contiguous ``t``; else ``(t.permute(dims), dims)`` where that view is contiguous
    (the same memory, no copy) and the permuted hash applies; else ``(t.contiguous(), None)``."""
    if t.is_contiguous():
        return t, None
    if t.element_size() in (2, 4) and not t.is_complex() and t.numel() <= _PERMUTED_MAX:
        dims = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
        p = t.permute(dims)
        if p.is_contiguous():
            return p, dims
    return t.contiguous(), None


def _permuted_weights(p: torch.Tensor, dims: tuple) -> torch.Tensor:
    """The weights of ``p``'s elements in memory order, where ``p`` is ``t.permute(dims)`` for a logical ``t``."""
    shape = [0] * p.dim()
    for k, d in enumerate(dims):
        shape[d] = p.shape[k]
    key = (tuple(shape), dims, p.device)
    w = _permuted.get(key)
    if w is None:
        w = _spelled(p.numel(), p.device).view(shape).permute(dims).contiguous().view(-1)
        if sum(x.numel() for x in _permuted.values()) + w.numel() > _PERMUTED_BUDGET:
            _permuted.clear()
        _permuted[key] = w
    return w


_scratch: dict = {}


def _buffer(n: int, device) -> torch.Tensor:
    """``n`` int32 of a reused buffer: a fresh large tensor per op costs page faults on every trace."""
    buf = _scratch.get(device)
    if buf is None or buf.numel() < n:
        buf = _scratch[device] = torch.empty(n, dtype=torch.int32, device=device)
    return buf[:n]


def _products(bits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``bits * w``, into the reused buffer for int32."""
    if bits.dtype != torch.int32:
        return bits * w
    return torch.mul(bits, w, out=_buffer(bits.numel(), bits.device))


# devices with an integer GEMM (the one-pass hash); the others take products and sums
_INT_GEMM = {"cpu"}
_rows_u: dict = {}  # (row count, [u, 1] storage) -> its first rows


def _words(bits: torch.Tensor) -> torch.Tensor:
    """``[sum(bits * weights), sum(bits)]`` mod 2**32, an int32 tensor of two.

    32-bit elements (float32, int32) go row by row through the weight grid. On CPU one integer GEMM,
    ``[v; 1] @ rows.T``, gives every row's weighted sum and its plain sum in a single pass over the
    tensor (2-3x the speed of products and two sums, which read it three times); elsewhere (CUDA has no
    integer GEMM) products into a reused buffer, a row sum and a plain sum. The elements past the last
    full row, and other widths, multiply by the weights spelled out. Every path gives the same numbers:
    the same weights, exact arithmetic mod 2**32 (int32 products and sums wrap).
    """
    n = bits.numel()
    m = n // _K if bits.dtype == torch.int32 else 0
    if m == 0:
        return torch.stack([_products(bits, _weights_for(n, bits.device)).sum(dtype=torch.int32),
                            bits.sum(dtype=torch.int32)])
    u, v, vone, uone = _uv(m + 1, bits.device)
    body = (bits if n == m * _K else bits.narrow(0, 0, m * _K)).view(m, _K)  # narrow: a slice costs ~5 us
    if bits.device.type in _INT_GEMM:
        # [v; 1] @ rows.T: each row's weighted and plain sums ([2, m]; this orientation makes a contiguous
        # dot per row); @ [u, 1]: the first weighted by the row weights, both summed (the diagonal)
        rows_u = _rows_u.get((m, uone.data_ptr()))
        if rows_u is None:  # a step meets a few row counts again and again: the view is cached
            if len(_rows_u) > 1024:
                _rows_u.clear()
            rows_u = _rows_u[m, uone.data_ptr()] = uone.narrow(0, 0, m)
        words = torch.mm(torch.mm(vone, body.t()), rows_u).diagonal()
    else:
        rows = torch.mul(body, v, out=_buffer(m * _K, bits.device).view(m, _K)).sum(1, dtype=torch.int32)
        words = torch.stack([(rows * u[:m]).sum(dtype=torch.int32), body.sum(dtype=torch.int32)])
    if n > m * _K:
        tail = bits[m * _K:]
        words = words + torch.stack([(tail * (v[: n - m * _K] * u[m])).sum(dtype=torch.int32),
                                     tail.sum(dtype=torch.int32)])
    return words


def _hash_words(t: torch.Tensor, dims: tuple | None = None) -> torch.Tensor:
    """The two hash words of ``t`` (int32 [2]); with ``dims``, of the logical tensor that ``t`` (contiguous)
    is a permutation of."""
    if dims is None:
        return _words(_bits(t))
    bits = t.reshape(-1).view(_BITS[t.element_size()])
    w = _permuted_weights(t, dims)
    if bits.dtype == torch.int32 and bits.device.type in _INT_GEMM:
        weighted = torch.dot(bits, w)  # one pass, as the GEMM of the contiguous path
    else:
        weighted = _products(bits, w).sum(dtype=torch.int32)
    return torch.stack([weighted, bits.sum(dtype=torch.int32)])


def _hex(h: list[int]) -> str:
    return f"{h[0] & 0xFFFFFFFF:08x}{h[1] & 0xFFFFFFFF:08x}"


def tensor_hash(t: torch.Tensor) -> str:
    """Bitwise hash: the raw bits as integers times position weights, summed, and the plain sum of the bits.

    64 bits in all: any one changed element changes both words; a reordering changes the weighted one.
    """
    return _hex(_hash_words(*_dense_order(t.detach())).tolist())


def summarize(t: torch.Tensor, known_hash: str | None = None) -> TensorStats:
    """Shape, dtype, min/max/mean/std/norm and NaN/Inf counts plus the bitwise hash (``known_hash``: ``t``'s
    ``tensor_hash``, where the caller computed it already).

    Four passes over the tensor, no float64 copy of it: the hash's one (on CPU), sum, dot (norm) and
    aminmax. Statistics accumulate in float32 (float64 for float64 tensors): they are for people to read,
    the errors that judge a divergence are computed elementwise in float64.
    """
    t = t.detach()
    shape, dtype = tuple(t.shape), dtype_name(t)
    # contiguous, or a permutation of t over the same memory (the statistics do not depend on the order,
    # the hash is computed for t's logical order), or one copy that the hash and the statistics share
    t, dims = _dense_order(t)
    n = t.numel()
    h = known_hash if known_hash is not None else _hex(_hash_words(t, dims).tolist())
    if n == 0:
        return TensorStats(shape, dtype, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, h)
    x = t.abs() if t.is_complex() else t
    if not x.dtype.is_floating_point:
        x = x.to(torch.float64)
    elif x.element_size() < 4:
        x = x.float()
    nan = inf = 0
    flat = x.reshape(-1)
    s, nrm, mn, mx = torch.stack([flat.sum(), torch.dot(flat, flat).sqrt(), *torch.aminmax(flat)]).tolist()
    if not (math.isfinite(s) and math.isfinite(nrm)):
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        x = x[torch.isfinite(x)]
        n = x.numel()
        if n == 0:
            return TensorStats(shape, dtype, math.nan, math.nan, math.nan, math.nan, math.nan, nan, inf, h)
        s, nrm = torch.stack([x.sum(), torch.linalg.vector_norm(x)]).tolist()
        mn, mx = torch.stack(torch.aminmax(x)).tolist()
        flat = x
    return _finish(shape, dtype, n, s, nrm, mn, mx, nan, inf, h, centered=lambda: _variance(flat))


# mean^2 over the one-pass variance past which E[x^2] - mean^2 has lost its digits to cancellation (a tensor
# of values 1000 +- 0.001 read std 0 or ~0.06 in fp32): the variance is then taken again, centred
_CANCELS = 16.0


def _finish(shape, dtype, n, s, nrm, mn, mx, nan, inf, h, centered=None) -> TensorStats:
    """``centered()``, when given, is the sample variance taken in a second, centred pass: used only where the
    one-pass variance cancelled (a mean far from the spread; the summary's common case costs nothing more)."""
    mean = s / n
    var = max(nrm * nrm / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 0.0)
    if centered is not None and n > 1 and mn != mx and mean * mean > _CANCELS * var:
        var = centered()
    return TensorStats(shape, dtype, float(mn), float(mx), mean, math.sqrt(var), nrm, nan, inf, h)


def _variance(x: torch.Tensor) -> float:
    """Sample variance of ``x``'s elements, centred (aten's CPU kernel accumulates float32 in float64)."""
    return float(torch.var(x.reshape(-1)))


SMALL = 32768  # tensors up to this many elements are summarised together, a few kernels for all of them
SERIAL_MAX = 1 << 23  # tensors up to this many elements are summarised with one intra-op thread
_layouts: dict[tuple, tuple] = {}


def _group_layout(lengths: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated hash weights and segment ids for tensors of ``lengths`` (cached: a step repeats them)."""
    key = (lengths, device)
    hit = _layouts.get(key)
    if hit is None:
        w = torch.cat([_weights_for(n, device) for n in lengths])
        seg = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      torch.tensor(lengths, device=device))
        if len(_layouts) > 16:
            _layouts.clear()
        hit = _layouts[key] = (w, seg)
    return hit


def _group(ts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small tensors of one 4-byte dtype as one int32 concatenation, its segment ids, and their two hash
    words per tensor ([2, len(ts)], the same numbers as ``tensor_hash``'s), by segment sums."""
    w, seg = _group_layout(tuple(t.numel() for t in ts), ts[0].device)
    bits = torch.cat([_bits(t.detach()) for t in ts])
    hashes = torch.zeros(2, len(ts), dtype=torch.int32, device=bits.device)
    hashes[0].index_add_(0, seg, _products(bits, w))
    hashes[1].index_add_(0, seg, bits)
    return bits, seg, hashes


def _summarize_group(ts: list[torch.Tensor]) -> list[TensorStats]:
    """float32 tensors summarised together: one concatenation, segment sums, the same hash as ``summarize``."""
    lengths = tuple(t.numel() for t in ts)
    bits, seg, hashes = _group(ts)
    device, x, k = bits.device, bits.view(torch.float32), len(ts)
    f = torch.zeros(4, k, dtype=torch.float32, device=device)
    f[0].index_add_(0, seg, x)
    f[1].index_add_(0, seg, x * x)
    f[2].scatter_reduce_(0, seg, x, "amin", include_self=False)
    f[3].scatter_reduce_(0, seg, x, "amax", include_self=False)
    out = []
    for t, n, (h1, h2), (s, sq, mn, mx) in zip(ts, lengths, hashes.t().tolist(), f.t().tolist()):
        if not (math.isfinite(s) and math.isfinite(sq)):
            out.append(summarize(t))  # NaN/Inf (or an overflowing square): counted exactly, one by one
            continue
        out.append(_finish(tuple(t.shape), "float32", n, s, math.sqrt(sq), mn, mx, 0, 0, _hex([h1, h2]),
                           centered=lambda t=t: _variance(t.detach())))
    return out


def summarize_many(tensors: list[torch.Tensor]) -> list[TensorStats]:
    """``[summarize(t) for t in tensors]``, the small float32 ones together (same hashes, statistics in float32).

    A traced step summarises every op's output; most are small (biases, norms' statistics, scalars), and
    for those the dozen kernel launches of one ``summarize`` cost more than the arithmetic.

    Tensors up to ``SERIAL_MAX`` elements are summarised with one intra-op thread: each reduction over a
    cache-sized tensor takes tens of microseconds, less than a fork/join of the thread pool, and on a
    machine whose cores are busy every join waits for a descheduled worker (measured: the same step's
    summaries took 2-9 s at 2 threads, 0.3-1.3 s at one). Larger tensors use the caller's threads.
    (Python threads each taking a share of the tensors gained nothing on the 2-vCPU machine the figures
    come from, measured: the reductions did not scale past one vCPU there.)
    """
    out: list = [None] * len(tensors)
    groups: dict = {}
    big = []
    with one_thread():
        for i, t in enumerate(tensors):
            if t.dtype == torch.float32 and 0 < t.numel() <= SMALL and t.layout == torch.strided:
                groups.setdefault(t.device, []).append(i)
            elif t.numel() > SERIAL_MAX:
                big.append(i)
            else:
                out[i] = summarize(t)
        for idx in groups.values():
            for i, st in zip(idx, _summarize_group([tensors[i] for i in idx])):
                out[i] = st
    for i in big:
        out[i] = summarize(tensors[i])
    _scratch.clear()  # the products buffer lives for one call: as large as the largest tensor summarised
    return out


def hash_many(tensors: list[torch.Tensor]) -> list[str]:
    """``[tensor_hash(t) for t in tensors]``: the small 4-byte ones together, the rest one by one.

    One pass of ``summarize_many``'s four (on CPU): what a trace compared with a reference computes first,
    because a tensor with the reference's bits has the reference's statistics.
    """
    words: dict = {}
    groups: dict = {}
    with one_thread():
        for i, t in enumerate(tensors):
            if t.element_size() == 4 and not t.is_complex() and 0 < t.numel() <= SMALL \
                    and t.layout == torch.strided:
                groups.setdefault(t.device, []).append(i)
            else:
                words[i] = _hash_words(*_dense_order(t.detach()))
        out: list = [None] * len(tensors)
        if words:
            for i, h in zip(words, torch.stack([w.cpu() for w in words.values()]).tolist()):
                out[i] = _hex(h)
        for idx in groups.values():
            for i, h in zip(idx, _group([tensors[i] for i in idx])[2].t().tolist()):
                out[i] = _hex(h)
    _scratch.clear()
    return out
