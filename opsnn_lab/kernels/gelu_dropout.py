"""Bias + pointwise activation + counter-based dropout, forward and backward: Triton kernels and torch reference.

Activations (named as in ``torch.nn.functional`` / Hugging Face ``ACT2FN``): ``gelu`` (erf), ``gelu_tanh``
(GPT-2's ``gelu_new``), ``quick_gelu`` (``x * sigmoid(1.702 x)``, CLIP), ``silu`` and ``relu``.
``act_value_and_grad`` / ``act_forward`` / ``act_backward`` are shared with the gated-MLP kernels.

Forward keeps only the pre-activation ``h``; backward regenerates the dropout mask from (seed, offset)
and recomputes the activation (and, on request, the forward output that a following Linear needs for its weight
gradient). The bias gradient is reduced in two fixed-order stages (per-program partial column sums,
then one pass over the partials), never with atomics, so it is bitwise deterministic from run to run. (With and
without ``want_out`` the backward is compiled apart; on an H200 the two agreed to rounding, not to the bit.)
The forward applies the activation to ``h + bias`` as stored in ``h``'s dtype, as eager does, so the
backward's recomputed output is the forward's, bit for bit.

Element ``(i, j)`` of an ``(M, N)`` tensor uses the dropout counter ``offset + i * N + j`` (see ``rng``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opsnn_lab._checks import check_choice, check_range, check_tensor
from opsnn_lab.kernels._dispatch import backend_for, calculate_settings
from opsnn_lab.kernels.column_sum import column_sum
from opsnn_lab.kernels.rng import dropout_mask, keep_threshold, seed_keys

try:
    import triton
    import triton.language as tl

    from opsnn_lab.kernels.rng import dropout_keep
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["ACTS", "act_forward", "act_backward", "act_dropout_fwd", "act_dropout_bwd", "act_dropout_fwd_reference",
           "act_dropout_bwd_reference", "gelu_dropout_fwd", "gelu_dropout_bwd", "gelu_dropout_fwd_reference",
           "gelu_dropout_bwd_reference"]

ACTS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu")  # index = the kernels' ACT constexpr
_APPROX = {"none": "gelu", "tanh": "gelu_tanh"}  # nn.GELU(approximate=...) -> activation name
_QUICK = 1.702
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_TILE_N = 1024  # columns per program (the row is tiled so N is unbounded)
_ROWS = 16  # rows per program: each program's bias partial covers 16 rows, the second stage M / 16


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


# --------------------------------------------------------------------------- torch reference
def _wide(h):
    # Half-precision inputs are computed in fp32 and rounded once (eager rounds after every op).
    return h.float() if h.dtype in (torch.float16, torch.bfloat16) else h


def act_forward(h, act):
    """``act(h)`` as a new tensor of h's dtype."""
    if act == "gelu":
        return F.gelu(h)
    if act == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if act == "silu":
        return F.silu(h)
    if act == "relu":
        return F.relu(h)
    w = _wide(h)
    return (w * torch.sigmoid(_QUICK * w)).to(h.dtype)


def act_backward(grad, h, act):
    """``grad * act'(h)`` as a new tensor of h's dtype."""
    if act in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, h, approximate="tanh" if act == "gelu_tanh" else "none")
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, h)
    if act == "relu":
        return torch.ops.aten.threshold_backward(grad, h, 0)
    return _quick_gelu_grad(grad, h, want_out=False)[0]


def _quick_gelu_grad(grad, h, want_out: bool):
    """QuickGELU's ``grad * act'(h)`` and, when ``want_out``, ``act(h)``, from one sigmoid.

    ``act(x) = x s`` with ``s = sigmoid(1.702 x)``; ``act'(x) = s + 1.702 x s (1 - s)``: six passes for both
    (the output is ``act_forward``'s bits), where the two computed apart take eleven.
    """
    w = _wide(h)
    s = torch.mul(w, _QUICK).sigmoid_()
    xs = w * s
    d = torch.addcmul(s, xs, 1.0 - s, value=_QUICK).mul_(_wide(grad))
    return d.to(h.dtype), (xs.to(h.dtype) if want_out else None)


def act_dropout_fwd_reference(h, p, seed, offset, act="gelu", bias=None):
    """Torch path: ``(out, h)``; with ``bias``, ``h`` is updated in place to ``h + bias`` first."""
    if bias is not None:
        h.add_(bias)
    out = act_forward(h, act)
    if p > 0:  # float 0/1 mask, then the rescale: x * m is exact, so one rounding as in nn.Dropout
        out.mul_(dropout_mask(seed, offset, h.shape, p, h.device, dtype=h.dtype)).mul_(_scale(p))
    return out, h


def act_dropout_bwd_reference(grad_out, h, p, seed, offset, act="gelu", want_bias=False, want_out=False):
    """Torch path: ``(grad_h, grad_bias | None, out | None)`` with ``out`` the recomputed forward output."""
    keep = dropout_mask(seed, offset, h.shape, p, h.device, dtype=h.dtype) if p > 0 else None
    grad_kept = grad_out if keep is None else grad_out * keep
    if act == "quick_gelu":  # the output and the gradient share the sigmoid
        grad_h, out = _quick_gelu_grad(grad_kept, h, want_out)
    else:
        out = act_forward(h, act) if want_out else None
        grad_h = act_backward(grad_kept, h, act)
    if out is not None and keep is not None:
        out.mul_(keep).mul_(_scale(p))
    if keep is not None:
        grad_h.mul_(_scale(p))
    grad_bias = grad_h.sum(0) if want_bias else None
    return grad_h, grad_bias, out


def gelu_dropout_fwd_reference(h, p, seed, offset, approximate="none", bias=None):
    """``act_dropout_fwd_reference`` with nn.GELU's ``approximate`` ("none" or "tanh")."""
    return act_dropout_fwd_reference(h, p, seed, offset, _APPROX[approximate], bias)


def gelu_dropout_bwd_reference(grad_out, h, p, seed, offset, approximate="none", want_bias=False, want_out=False):
    """``act_dropout_bwd_reference`` with nn.GELU's ``approximate``."""
    return act_dropout_bwd_reference(grad_out, h, p, seed, offset, _APPROX[approximate], want_bias, want_out)


# --------------------------------------------------------------------------- Triton kernels
if triton is not None:

    @triton.jit
    def act_value_and_grad(x, ACT: tl.constexpr):
        """``(act(x), act'(x))`` in fp32 for ``ACT`` = index into ``ACTS``."""
        # All but relu are x * cdf(x): gelu's cdf is 0.5 (1 + erf(x / sqrt 2)), gelu_tanh's
        # 0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), quick_gelu's sigmoid(1.702 x), silu's sigmoid(x).
        if ACT == 4:
            y = tl.where(x > 0.0, x, 0.0)
            dy = tl.where(x > 0.0, 1.0, 0.0)
        else:
            if ACT == 0:
                cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
                dcdf = 0.3989422804014327 * tl.exp(-0.5 * x * x)
            elif ACT == 1:
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)  # tanh(u), saturates cleanly at +-1
                cdf = 0.5 * (1.0 + t)
                dcdf = 0.5 * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
            else:
                k = 1.702 if ACT == 2 else 1.0
                cdf = 1.0 / (1.0 + tl.exp(-k * x))
                dcdf = k * cdf * (1.0 - cdf)
            y = x * cdf
            dy = cdf + x * dcdf
        return y, dy

    @triton.jit
    def _act_dropout_fwd_kernel(
        H,  # pointer to the (M, N) pre-activation without bias; h + bias is written back when HAS_BIAS
        BIAS,  # pointer to the (N,) bias (unused unless HAS_BIAS)
        OUT,  # pointer to the (M, N) output, dropout(act(h))
        M,  # rows
        N,  # columns
        OFFSET,  # dropout counter of element (0, 0)
        S1,  # seed word 1 (rng.seed_keys)
        S2,  # seed word 2
        THRESHOLD,  # keep iff u16 >= THRESHOLD (rng.keep_threshold)
        SCALE,  # 1 / (1 - p)
        HAS_BIAS: tl.constexpr,  # add the bias and store the pre-activation
        DROPOUT: tl.constexpr,  # p > 0
        ACT: tl.constexpr,  # activation, index into ACTS
        ROWS: tl.constexpr,  # rows per program
        BLOCK_N: tl.constexpr,  # columns per program
    ):
        # Bytes per element: read h (s), write out (s), write h + bias (s) with bias: 2s-3s, s = dtype size.
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_BIAS:
            b = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)
        for r in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + r
            idx = row * N + cols
            m = cmask & (idx < M * N)
            x = tl.load(H + idx, mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:  # the activation reads h + bias as stored, as eager's and the backward's recompute do
                z = (x + b).to(H.dtype.element_ty)
                tl.store(H + idx, z, mask=m)
                x = z.to(tl.float32)
            y, _ = act_value_and_grad(x, ACT)
            if DROPOUT:
                keep = dropout_keep(OFFSET + idx, S1, S2, THRESHOLD)
                y = tl.where(keep, y * SCALE, 0.0)
            tl.store(OUT + idx, y.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _act_dropout_bwd_kernel(
        GRAD,  # pointer to the (M, N) upstream gradient
        H,  # pointer to the (M, N) saved pre-activation
        GRAD_H,  # pointer to the (M, N) gradient w.r.t. h (output)
        OUT,  # pointer to the (M, N) recomputed forward output (unused unless WANT_OUT)
        PARTIAL,  # pointer to the (cdiv(M, ROWS), N) fp32 partial bias sums (unused unless WANT_BIAS)
        M,  # rows
        N,  # columns
        OFFSET,  # dropout counter of element (0, 0)
        S1,  # seed word 1
        S2,  # seed word 2
        THRESHOLD,  # keep iff u16 >= THRESHOLD
        SCALE,  # 1 / (1 - p)
        DROPOUT: tl.constexpr,  # p > 0
        ACT: tl.constexpr,  # activation, index into ACTS
        WANT_OUT: tl.constexpr,  # also write the recomputed forward output
        WANT_BIAS: tl.constexpr,  # also write partial bias sums
        ROWS: tl.constexpr,  # rows per program
        BLOCK_N: tl.constexpr,  # columns per program
    ):
        # Bytes per element: read grad, h (2s), write grad_h (s), out (s) if WANT_OUT: 3s-4s;
        # partial sums add 4 * N bytes per ROWS rows.
        pid_m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc = tl.full([BLOCK_N], 0.0, tl.float32)  # not tl.zeros: a @jit helper, see tests
        for r in range(ROWS):
            row = pid_m.to(tl.int64) * ROWS + r
            idx = row * N + cols
            m = cmask & (idx < M * N)
            x = tl.load(H + idx, mask=m, other=0.0).to(tl.float32)
            g = tl.load(GRAD + idx, mask=m, other=0.0).to(tl.float32)
            y, dy = act_value_and_grad(x, ACT)
            if DROPOUT:
                keep = dropout_keep(OFFSET + idx, S1, S2, THRESHOLD)
                g = tl.where(keep, g * SCALE, 0.0)
                y = tl.where(keep, y * SCALE, 0.0)
            gh = g * dy
            tl.store(GRAD_H + idx, gh.to(GRAD_H.dtype.element_ty), mask=m)
            if WANT_OUT:
                tl.store(OUT + idx, y.to(OUT.dtype.element_ty), mask=m)
            if WANT_BIAS:  # one rounding per term (g = 0 off the mask)
                acc = tl.fma(g, dy, acc)
        if WANT_BIAS:
            tl.store(PARTIAL + pid_m.to(tl.int64) * N + cols, acc, mask=cmask)


def _rng_args(p, seed, offset):
    s1, s2 = seed_keys(seed) if p > 0 else (0, 0)
    return offset, s1, s2, keep_threshold(p), _scale(p)


def _grid(m, n):
    block_n, warps = calculate_settings(min(n, _TILE_N))
    return (triton.cdiv(m, _ROWS), triton.cdiv(n, block_n)), block_n, warps


def _fwd_triton(h, p, seed, offset, act, bias):
    m, n = h.shape
    out = torch.empty_like(h)
    if h.numel():
        grid, block_n, warps = _grid(m, n)
        _act_dropout_fwd_kernel[grid](
            h, bias if bias is not None else h, out, m, n, *_rng_args(p, seed, offset),
            HAS_BIAS=bias is not None, DROPOUT=p > 0, ACT=ACTS.index(act),
            ROWS=_ROWS, BLOCK_N=block_n, num_warps=warps)
    return out, h


def _bwd_triton(grad_out, h, p, seed, offset, act, want_bias, want_out):
    m, n = h.shape
    grad_h = torch.empty_like(h)
    out = torch.empty_like(h) if want_out else None
    grad_bias = (torch.empty if m else torch.zeros)(n, dtype=h.dtype, device=h.device) if want_bias else None
    if h.numel():
        grid, block_n, warps = _grid(m, n)
        partial = torch.empty(grid[0], n, dtype=torch.float32, device=h.device) if want_bias else grad_h
        _act_dropout_bwd_kernel[grid](
            grad_out, h, grad_h, out if want_out else grad_h, partial, m, n, *_rng_args(p, seed, offset),
            DROPOUT=p > 0, ACT=ACTS.index(act), WANT_OUT=want_out, WANT_BIAS=want_bias,
            ROWS=_ROWS, BLOCK_N=block_n, num_warps=warps)
        if want_bias:
            column_sum(partial, grad_bias)
    return grad_h, grad_bias, out


def _check(h, p, act, name="h"):
    check_tensor(name, h, dtypes=_FLOATS, dim=2)
    check_range("p", p, 0.0, 1.0)
    check_choice("act", act, ACTS)


def act_dropout_fwd(h, p, seed, offset, act="gelu", bias=None):
    """``out = dropout(act(h [+ bias]))`` and the pre-activation.

    h: (M, N) float tensor (made contiguous); with ``bias`` (N,) of h's dtype, ``h`` is updated in place to
    ``h + bias`` (the GEMM before it can then skip its bias). Returns ``(out, h)``, both (M, N) in h's dtype.
    ``act`` in ``ACTS``; ``p`` in [0, 1]; ``seed``/``offset`` pick the mask (element (i, j) uses counter
    ``offset + i * N + j``).
    """
    _check(h, p, act)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(h.dtype,), dim=1, device=h.device)
        if bias.shape[0] != h.shape[1]:
            raise ValueError(f"bias must have {h.shape[1]} elements (h's columns), got {bias.shape[0]}")
    h = h.contiguous()
    if backend_for(h) == "triton":
        return _fwd_triton(h, p, seed, offset, act, None if bias is None else bias.contiguous())
    return act_dropout_fwd_reference(h, p, seed, offset, act, bias)


def act_dropout_bwd(grad_out, h, p, seed, offset, act="gelu", want_bias=False, want_out=False):
    """Gradient of ``dropout(act(h))`` w.r.t. ``h``, regenerating the mask.

    grad_out, h: (M, N) of one float dtype. Returns ``(grad_h, grad_bias, out)``: grad_h (M, N); grad_bias (N,)
    (sum of grad_h over rows, two-stage fixed order on Triton) when ``want_bias``; ``out`` (M, N), the
    recomputed forward output, when ``want_out``.
    """
    _check(h, p, act)
    check_tensor("grad_out", grad_out, dtypes=(h.dtype,), dim=2, device=h.device)
    if grad_out.shape != h.shape:
        raise ValueError(f"grad_out must have h's shape {tuple(h.shape)}, got {tuple(grad_out.shape)}")
    if backend_for(h) == "triton":
        return _bwd_triton(grad_out.contiguous(), h.contiguous(), p, seed, offset, act, want_bias, want_out)
    return act_dropout_bwd_reference(grad_out, h, p, seed, offset, act, want_bias, want_out)


def _gelu_act(approximate):
    check_choice("approximate", approximate, tuple(_APPROX))
    return _APPROX[approximate]


def gelu_dropout_fwd(h, p, seed, offset, approximate="none", bias=None):
    """``act_dropout_fwd`` for GELU, with nn.GELU's ``approximate`` ("none" or "tanh")."""
    return act_dropout_fwd(h, p, seed, offset, _gelu_act(approximate), bias)


def gelu_dropout_bwd(grad_out, h, p, seed, offset, approximate="none", want_bias=False, want_out=False):
    """``act_dropout_bwd`` for GELU, with nn.GELU's ``approximate``."""
    return act_dropout_bwd(grad_out, h, p, seed, offset, _gelu_act(approximate), want_bias, want_out)
