"""Counter-based RNG for dropout: a mask depends on (seed, offset) only, same bits in torch and Triton.

Convention. Element ``e`` of a tensor (row-major index, whatever the tensor's strides) drawn at
``offset`` uses the 64-bit counter ``c = offset + e``. Two counters share one 32-bit hash word
``w = c >> 1``: the even counter takes its low 16 bits, the odd one its high 16 bits. Element ``e`` is
kept by dropout with probability ``1 - p`` iff its 16-bit value ``u16(c) >= round(p * 65536)``.

Why not Philox (what ``tl.rand`` uses)? Philox-4x32-10 is ten rounds of 32x32->64 multiplies; written
as torch tensor ops on CPU that is ~60 passes over memory, as costly as the GEMM beside it. Here one
32-bit hash word serves TWO elements, and the word hash is the three-round multiply-xorshift hash
``x ^= x >> 16; x *= 0x045D9F3B`` (T. Mueller's integer hash, full avalanche) with the stream keys added
before the first and after the first multiply. Every shift is by 16, so on CPU ``x ^= x >> 16`` is one
pass over the int16 halves and the whole mask is 7 passes over ``numel / 2`` int32 words plus one
compare (a few ms for 8 x 128 x 3072 elements; the 1024 x 768 x 3072 GEMM takes ~70 ms and eager
``nn.Dropout`` ~60 ms). The keys come from the seed via splitmix64 and from the counter's high word via
``lowbias32``, so different seeds and different high words give unrelated streams. 16-bit resolution
quantizes ``p`` to multiples of 2**-16 (keep fraction off by at most 7.6e-6); the rescale stays
``1 / (1 - p)`` like ``nn.Dropout``. ``u16`` is the raw half with its top bit flipped, so that on CPU
the raw halves read as signed int16 compare directly against ``threshold - 32768``.

The torch path uses wrapping int32 arithmetic (two's complement, as every torch backend computes it);
``_words_reference`` is the same hash in int64
arithmetic masked to 32 bits, kept as the readable specification the tests compare against. The
Triton helpers (``counter_bits16``, ``dropout_keep``) compute it in uint32 and are callable from any
``@triton.jit`` kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opsnn_lab._checks import check_range, check_type
from opsnn_lab.kernels._dispatch import backend_for_device, calculate_settings

try:  # Triton is optional: the torch path below is the CPU implementation and the test oracle.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

__all__ = [
    "MAX_NUMEL",
    "seed_keys",
    "keep_threshold",
    "random_bits16",
    "uniform",
    "dropout_mask",
    "dropout_mul",
    "fuses_dropout_mul",
    "counter_bits16",
    "dropout_keep",
]

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (key schedule)
_MUL = 0x045D9F3B  # the word hash multiplier (all shifts by 16)
MAX_NUMEL = 1 << 32  # elements per draw; modules advance their offset by this much per call


def _wrap32(v: int) -> int:
    """An unsigned 32-bit value as the int32 with the same bits."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit seed words ``(s1, s2)`` every path derives its keys from (passed to kernels)."""
    check_type("seed", seed, int)
    if isinstance(seed, bool) or not 0 <= seed <= _M64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    s = _splitmix64(seed)
    return s & _M32, s >> 32


def _word_keys(s1: int, s2: int, hi: int) -> tuple[int, int]:
    k1 = _mix32(hi ^ s1)
    return k1, _mix32(k1 ^ s2)


def keep_threshold(p: float) -> int:
    """``round(p * 65536)``: an element is kept iff its 16-bit value is >= this (0 keeps all)."""
    check_range("p", p, 0.0, 1.0)
    return int(round(float(p) * 65536))


def _check_draw(offset: int, numel: int) -> None:
    check_type("offset", offset, int)
    check_type("numel", numel, int)
    if isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    if isinstance(numel, bool) or not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel must be in [0, 2**32], got {numel!r}")
    if offset + numel > 1 << 63:
        raise ValueError(f"offset + numel must be <= 2**63, got {offset} + {numel}")


def _halves16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high int16 halves of int32 words, as views (little-endian: the low half first)."""
    halves = x.view(torch.int16).view(-1, 2)
    return halves[:, 0], halves[:, 1]


def _xorshift16_(x: torch.Tensor, halves: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x ^= x >>> 16`` on int32 words in one pass: only the low half changes, by the high half. ``halves``:
    ``_halves16(x)``, made once for the passes over one ``x`` (four view ops a pass otherwise)."""
    low, high = halves
    low.bitwise_xor_(high)
    return x


def _hash_segment(s1: int, s2: int, hi: int, lo: int, n: int, device) -> torch.Tensor:
    """Hash words ``(hi << 32) + lo + j`` for ``j < n`` (no high-word carry inside) as int32: 7 passes.

    Spec (uint32): ``x = lo + j + k1; x ^= x >> 16; x = x * M + k2; x ^= x >> 16; x *= M; x ^= x >> 16``.
    """
    k1, k2 = _word_keys(s1, s2, hi)
    start = _wrap32((lo + k1) & _M32)
    if start + n <= 1 << 31:
        x = torch.arange(start, start + n, dtype=torch.int32, device=device)
    else:  # the int32 range wraps inside this segment
        x = torch.arange(n, dtype=torch.int32, device=device).add_(start)
    k2t = torch.scalar_tensor(_wrap32(k2), dtype=torch.int32, device=device)
    halves = _halves16(x)  # views stay valid: every pass below writes x in place
    _xorshift16_(x, halves)
    torch.add(k2t, x, alpha=_MUL, out=x)  # x * M + k2 in one pass
    _xorshift16_(x, halves).mul_(_MUL)
    return _xorshift16_(x, halves)


_SERIAL_MAX_NUMEL = 1 << 24  # up to 16 M elements (8 M words, ~10 ms on one core) the hash runs serially


class _serial:
    """Run the hash passes of a CPU draw of up to ``_SERIAL_MAX_NUMEL`` elements on one thread.

    Each pass is a few hundred microseconds of cached integer work, so a fork-join per pass costs more
    than it saves, and on a loaded machine a pass can stall waiting for a descheduled worker (measured:
    the attention core's fused fwd+bwd 1.9x eager with parallel hash passes, 1.2x serial, 2 threads,
    load ~7). Restores the thread count on exit.
    """

    def __init__(self, device, numel: int):
        self.active = (torch.device(device).type == "cpu" and numel <= _SERIAL_MAX_NUMEL
                       and torch.get_num_threads() > 1)

    def __enter__(self):
        if self.active:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.active:
            torch.set_num_threads(self.threads)


def _hashed_words(seed: int, offset: int, numel: int, device) -> torch.Tensor:
    """int32 words covering counters ``[offset, offset + numel)`` (split where the high word changes)."""
    s1, s2 = seed_keys(seed)
    first, last = offset >> 1, (offset + numel - 1) >> 1
    parts, w = [], first
    while w <= last:
        hi, lo = w >> 32, w & _M32
        n = min(last - w + 1, (1 << 32) - lo)
        parts.append(_hash_segment(s1, s2, hi, lo, n, device))
        w += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _signed16(seed: int, offset: int, numel: int, device) -> torch.Tensor:
    """``u16(c) - 32768`` as int16 for every counter of the draw: the raw 16 bits read as signed (a view)."""
    words = _hashed_words(seed, offset, numel, device)
    skip = offset & 1
    return words.view(torch.int16)[skip:skip + numel]  # little-endian: low half = even counter


def random_bits16(seed: int, offset: int, numel: int, device="cpu") -> torch.Tensor:
    """The 16-bit values ``u16(offset + e)`` for ``e < numel`` as int32 in ``[0, 65536)``."""
    _check_draw(offset, numel)
    seed_keys(seed)
    if numel == 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    return _signed16(seed, offset, numel, device).to(torch.int32).add_(32768)


def uniform(seed: int, offset: int, numel: int, device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform values ``(u16 + 0.5) / 65536`` in (0, 1): 16-bit resolution, meant for dropout-like use."""
    return random_bits16(seed, offset, numel, device).to(dtype).add_(0.5).mul_(1.0 / 65536)


def dropout_mask(seed: int, offset: int, shape: Sequence[int] | int, p: float, device="cpu",
                 dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Keep-mask of ``shape`` (kept with probability ``1 - p``) for row-major counters from ``offset``.

    ``dtype=torch.bool`` gives True = kept; a floating dtype gives 1.0 / 0.0 directly from the compare.
    Prefer the float form for arithmetic: on CPU, ``x.mul_(bool_mask)`` takes a casting path (~3x the CPU
    time of a float multiply), while the compare writes floats nearly as cheaply as bools.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = math.prod(shape)
    _check_draw(offset, numel)
    seed_keys(seed)
    thr = keep_threshold(p)
    if thr == 0 or numel == 0:
        return torch.ones(shape, dtype=dtype, device=device)
    if thr == 65536:
        return torch.zeros(shape, dtype=dtype, device=device)
    out = torch.empty(numel, dtype=dtype, device=device)
    if backend_for_device(device) == "triton":  # one pass writing the mask, not the torch path's ~10 on a GPU
        _launch(_keep_kernel, numel, out.view(torch.uint8) if dtype == torch.bool else out, offset,
                *seed_keys(seed), thr, numel)
        return out.view(shape)
    with _serial(device, numel):
        return torch.ge(_signed16(seed, offset, numel, device), thr - 32768, out=out).view(shape)


def fuses_dropout_mul(x: torch.Tensor) -> bool:
    """Whether :func:`dropout_mul` applies the mask to ``x`` in one pass without making it (a contiguous
    fp32/fp16/bf16 tensor where the Triton kernels run); callers that apply one mask to several tensors make
    it once with :func:`dropout_mask` otherwise."""
    return (x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.is_contiguous()
            and backend_for_device(x.device) == "triton")


def dropout_mul(x: torch.Tensor, seed: int, offset: int, p: float, scale: float = 1.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x * keep * scale`` with ``keep = dropout_mask(seed, offset, x.shape, p)`` (row-major counters), into
    ``out`` (``x`` itself for in place) or a new tensor: the same bits as multiplying by the float mask, then by
    ``scale`` (zeros keep their sign, NaN stays NaN). On a GPU one pass that never writes the mask, for a
    contiguous fp32/fp16/bf16 ``x``; otherwise the mask is made first."""
    check_type("x", x, torch.Tensor)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must match x's shape, dtype and device, got {tuple(out.shape)} {out.dtype} "
                         f"{out.device} for {tuple(x.shape)} {x.dtype} {x.device}")
    numel = x.numel()
    _check_draw(offset, numel)
    thr = keep_threshold(p)
    dst = torch.empty_like(x) if out is None else out
    if not (fuses_dropout_mul(x) and dst.is_contiguous() and 0 < thr < 65536 and numel > 0):
        keep = dropout_mask(seed, offset, x.shape, p, x.device, dtype=x.dtype)
        torch.mul(x, keep, out=dst)
        return dst if scale == 1.0 else dst.mul_(scale)
    _launch(_dropout_mul_kernel, numel, x, dst, offset, *seed_keys(seed), thr, float(scale), numel)
    return dst


def _words_reference(seed: int, offset: int, numel: int) -> torch.Tensor:
    """Specification: ``u16`` values by int64 arithmetic masked to 32 bits (slow; tests only)."""
    s1, s2 = seed_keys(seed)
    c = torch.arange(offset, offset + numel, dtype=torch.int64)
    w = c >> 1
    hi, lo = w >> 32, w & _M32

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * _MUL1) & _M32
        x = x ^ (x >> 15)
        x = (x * _MUL2) & _M32
        return x ^ (x >> 16)

    k1 = mix(hi ^ s1)
    k2 = mix(k1 ^ s2)
    x = (lo + k1) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL + k2) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    return ((x >> ((c & 1) * 16)) & 0xFFFF) ^ 0x8000


if triton is not None:

    @triton.jit
    def _mix32_tl(x):
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def counter_bits16(offs, S1, S2):
        """``u16(c)`` as int32 for an int64 tensor of counters ``offs``; S1, S2 from ``seed_keys``."""
        w = offs >> 1
        lo = (w & 0xFFFFFFFF).to(tl.uint32)
        hi = (w >> 32).to(tl.uint32)
        k1 = _mix32_tl(hi ^ S1.to(tl.uint32))
        k2 = _mix32_tl(k1 ^ S2.to(tl.uint32))
        x = lo + k1
        x ^= x >> 16
        x = x * 0x045D9F3B + k2
        x ^= x >> 16
        x *= 0x045D9F3B
        x ^= x >> 16
        shift = ((offs & 1) * 16).to(tl.uint32)
        return (((x >> shift) & 0xFFFF) ^ 0x8000).to(tl.int32)

    @triton.jit
    def dropout_keep(offs, S1, S2, THRESHOLD):
        """Keep-mask (int1) for counters ``offs``: ``u16 >= THRESHOLD`` (THRESHOLD from ``keep_threshold``)."""
        return counter_bits16(offs, S1, S2) >= THRESHOLD

    @triton.jit
    def _bits16_kernel(
        OUT,  # pointer to the int32 output, numel values
        OFFSET,  # counter of element 0
        S1,  # seed word 1 (seed_keys)
        S2,  # seed word 2
        NUMEL,  # number of values
        BLOCK: tl.constexpr,  # values per program
    ):
        # Bytes: writes 4 per value, reads nothing; the hash is ~25 integer ops per value.
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + idx, counter_bits16(OFFSET + idx, S1, S2), mask=idx < NUMEL)


    @triton.jit
    def _keep_kernel(
        OUT,  # pointer to the mask, numel values: 1 / 0 in its dtype (a bool mask as uint8)
        OFFSET,  # counter of element 0
        S1,  # seed word 1 (seed_keys)
        S2,  # seed word 2
        THRESHOLD,  # keep_threshold(p)
        NUMEL,  # number of values
        BLOCK: tl.constexpr,  # values per program
    ):
        # Bytes: writes 1-4 per value, reads nothing.
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = tl.where(dropout_keep(OFFSET + idx, S1, S2, THRESHOLD), 1.0, 0.0)  # via fp32: the interpreter
        tl.store(OUT + idx, keep.to(OUT.dtype.element_ty), mask=idx < NUMEL)  # casts int1 -> bf16 bitwise


    @triton.jit
    def _dropout_mul_kernel(
        X,  # pointer to the contiguous input, numel values
        OUT,  # pointer to the contiguous output (X itself for in place)
        OFFSET,  # counter of element 0
        S1,  # seed word 1 (seed_keys)
        S2,  # seed word 2
        THRESHOLD,  # keep_threshold(p)
        SCALE,  # applied after the mask, as a second multiply (the torch path's rounding)
        NUMEL,  # number of values
        BLOCK: tl.constexpr,  # values per program
    ):
        # Bytes: reads and writes numel values once; the mask is never stored.
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < NUMEL
        x = tl.load(X + idx, mask=valid, other=0.0).to(tl.float32)
        keep = tl.where(dropout_keep(OFFSET + idx, S1, S2, THRESHOLD), 1.0, 0.0)
        y = (x * keep).to(OUT.dtype.element_ty).to(tl.float32) * SCALE  # x * 0 keeps the sign of zero, NaN
        tl.store(OUT + idx, y.to(OUT.dtype.element_ty), mask=valid)


def random_bits16_triton(seed: int, offset: int, numel: int, device="cpu") -> torch.Tensor:
    """``random_bits16`` computed by the Triton helper (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    _check_draw(offset, numel)
    s1, s2 = seed_keys(seed)
    out = torch.empty(numel, dtype=torch.int32, device=device)
    if numel:
        _launch(_bits16_kernel, numel, out, offset, s1, s2, numel)
    return out


def _launch(kernel, numel: int, *args) -> None:
    """One program per 1024 counters (fewer for a short draw): the launch of every kernel in this module."""
    block, warps = calculate_settings(min(numel, 1024))
    kernel[(triton.cdiv(numel, block),)](*args, BLOCK=block, num_warps=warps)
