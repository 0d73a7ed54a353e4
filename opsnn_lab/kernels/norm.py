"""LayerNorm and RMSNorm, each optionally after a residual add: Triton kernels and torch reference.

Forward computes ``s = x + residual`` (rounded once to the input dtype, as eager's add), then the row
statistics in fp32 and ``y = xhat * (weight + weight_offset) + bias`` with ``xhat = (s - mean) * rstd``
(LayerNorm) or ``s * rstd`` (RMSNorm). What backward needs is ``s`` and one fp32 statistic per row
(``rstd``; LayerNorm also ``mean``), nothing else. ``weight_offset=1.0`` is Gemma's ``(1 + weight)``.
Or, where ``output_recoverable`` allows it, the output ``y`` and ``rstd`` only: ``norm_bwd_from_output``
recovers ``xhat = (y - bias) / weight`` (the same backward kernel with ``FROM_Y``; on the torch path one
elementwise pass for ``xhat`` and one row scaling more than aten's backward, which then runs with unit statistics).

The weight and bias gradients are reduced in two fixed-order stages (per-program partial column sums over
``_ROWS`` rows, then one pass over the partials), never with atomics: the same bits on every run.
"""

from __future__ import annotations

import math

import torch

from opsnn_lab._checks import check_tensor
from opsnn_lab.kernels._dispatch import _MAX_BLOCK, backend_for, calculate_settings
from opsnn_lab.kernels.column_sum import column_sum

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["norm_fwd", "norm_bwd", "norm_fwd_reference", "norm_bwd_reference", "norm_bwd_from_output",
           "norm_bwd_from_output_reference", "output_recoverable", "uses_triton", "RECOVER_MAX_BIAS"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ROWS = 16  # rows per backward program: each weight-gradient partial covers 16 rows
RECOVER_MAX_BIAS = 4.0  # output_recoverable: the largest |bias| / |weight| per column (2x margin to the edge, 8)


def _effective_weight(weight, weight_offset, dtype):
    if weight is None or not weight_offset:
        return weight
    return (weight.to(torch.promote_types(weight.dtype, torch.float32)) + weight_offset).to(dtype)


# --------------------------------------------------------------------------- torch reference
# the op's binding in torch's namespace where there is one: ~2.5 us a call less than through torch.ops
_fused_rms_norm = getattr(torch, "_fused_rms_norm", None) or torch.ops.aten._fused_rms_norm


def norm_fwd_reference(x, weight, bias, residual, eps, rms, weight_offset=0.0):
    """Torch path: ``(y, s, mean | None, rstd)``; aten's own fused row kernels, so eager's numerics and speed."""
    s = x if residual is None else x + residual
    n = s.shape[-1]
    w = _effective_weight(weight, weight_offset, s.dtype)
    if rms:
        y, rstd = _fused_rms_norm(s, [n], w, eps)
        if bias is not None:
            y = y.add_(bias)
        return y, s, None, rstd.view(-1)
    if s.dtype in (torch.bfloat16, torch.float16):  # aten keeps bf16/fp16 statistics: fp32 ones, y rounded once
        y, mean, rstd = torch.native_layer_norm(s.float(), [n], None if w is None else w.float(),
                                                None if bias is None else bias.float(), eps)
        return y.to(s.dtype), s, mean.view(-1), rstd.view(-1)
    y, mean, rstd = torch.native_layer_norm(s, [n], w, bias, eps)
    return y, s, mean.view(-1), rstd.view(-1)


def _rms_bwd(grad_y, s, rstd, w, want_w, xhat=None):
    # aten has no CPU backward for _fused_rms_norm: ds = rstd * (g - xhat * mean(g * xhat)), g = dy * w, in fp32.
    acc = torch.float64 if s.dtype == torch.float64 else torch.float32
    xhat = s.to(acc) * rstd if xhat is None else xhat
    dy = grad_y.to(acc)
    g = dy if w is None else dy * w.to(acc)
    ds = (g - xhat * (xhat * g).mean(-1, keepdim=True)).mul_(rstd)
    grad_w = (dy * xhat).sum(0).to(w.dtype) if want_w else None
    return ds.to(s.dtype), grad_w


def norm_bwd_reference(grad_y, s, mean, rstd, weight, rms, weight_offset=0.0, has_bias=False, grad_sum=None,
                       want_weight=True, bias=None):
    """Torch path: ``(grad_s, grad_weight | None, grad_bias | None)``; ``grad_sum`` (the gradient that
    reaches ``s`` directly, when the sum is also an output) is added to ``grad_s``. ``bias`` (optional) lets
    LayerNorm's aten backward produce the bias gradient in its own pass."""
    n = s.shape[-1]
    w = _effective_weight(weight, weight_offset, s.dtype)
    want_w = weight is not None and want_weight
    if rms:
        grad_s, grad_w = _rms_bwd(grad_y, s, rstd.view(-1, 1), w, want_w)
    else:
        in_pass = has_bias and bias is not None
        # bf16/fp16: aten's own low-precision backward sums the weight gradient in partial buffers of the input
        # dtype (2-3x the error of an fp32 sum rounded once, worse at one thread); run it in fp32 instead
        acc = torch.float32 if s.dtype in (torch.bfloat16, torch.float16) else s.dtype
        up = (lambda t: None if t is None else t.to(acc))
        grad_s, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            up(grad_y), up(s), [n], up(mean.view(-1, 1)), up(rstd.view(-1, 1)), up(w), up(bias) if in_pass else None,
            [True, want_w, in_pass])
        grad_s = grad_s.to(s.dtype)
        grad_w = grad_w.to(weight.dtype) if want_w else None
        if in_pass:
            return _add_sum(grad_s, grad_sum), grad_w, grad_b.to(bias.dtype)
    grad_b = grad_y.sum(0) if has_bias else None
    return _add_sum(grad_s, grad_sum), grad_w if want_w else None, grad_b


def output_recoverable(weight, bias, weight_offset, dtype) -> bool:
    """Whether ``xhat = (y - bias) / (weight + weight_offset)`` recovers the normalised input from the output
    ``y`` (rounded to ``dtype``) about as well as eager knows it. The error is ``ulp(y) / |w|``, about
    ``eps (|xhat| + |b| / |w|)``, plus ``tiny * eps / |w|`` where ``y`` is subnormal: so every effective weight
    finite and at least 4 x the dtype's smallest normal ``tiny`` (fp16: 2.4e-4), and ``|bias| <= RECOVER_MAX_BIAS *
    |weight|`` per column. Measured at the edge (weights 1 and 1/r, ``|b| = r |w|``, gradients correlated with
    ``y`` or not, fp32/bf16/fp16): within the 2 x eager error criterion up to r = 8, not at 16; RMSNorm without
    a bias passes at any weight spread tried (64)."""
    if weight is None:
        return bias is None or bool(torch.isfinite(bias).all())
    if weight.numel() == 0:
        return True
    # run once per parameter version, so once per training step: six small ops and one host read (on CUDA a
    # synchronisation), where a float64 copy and separate finiteness checks took thirteen
    w = weight.detach()
    if weight_offset:
        w = w.double() + weight_offset  # (1 + w) exactly, as the op forms it in fp32 from a bf16/fp16 weight
    aw = w.abs()
    smallest, largest = torch.aminmax(aw)  # a NaN weight makes both NaN: every comparison below is False
    ok = (smallest >= 4 * torch.finfo(dtype).tiny) & (largest <= torch.finfo(aw.dtype).max)
    if bias is not None:  # |bias| <= 4 |w| per column; a NaN or infinite bias fails it (w is finite here)
        ok = ok & (bias.detach().abs() <= RECOVER_MAX_BIAS * aw).all()
    return bool(ok)


def norm_bwd_from_output_reference(grad_y, y, rstd, weight, bias, rms, weight_offset=0.0, want_weight=True,
                                   want_bias=False, grad_sum=None):
    """Torch path of ``norm_bwd_from_output``: ``xhat`` in fp32 from ``y``; LayerNorm through aten's backward
    with unit statistics (``xhat`` is already centred and scaled), the row ``rstd`` applied after."""
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    if rms and weight is not None and bias is None:
        return _rms_bwd_from_output(grad_y, y, rstd, weight, weight_offset, want_weight, grad_sum, acc)
    w = None if weight is None else weight.to(acc) + weight_offset
    if w is None:  # read only below: y itself when it is already in acc
        xhat = y.to(acc) - bias.to(acc) if bias is not None else y.to(acc)
    elif bias is None:
        xhat = y * w.reciprocal()  # one pass; a bf16/fp16 y promotes to fp32 on the way
    else:  # y * (1 / w) - b / w in one pass (a multiply then an in-place subtract takes ~1.6x as long on CPU)
        inv = w.reciprocal()
        xhat = torch.addcmul(-(bias.to(acc) * inv), y, inv)
    want_w = weight is not None and want_weight
    dy = grad_y.to(acc)
    if rms:
        grad_s, grad_w = _rms_bwd(dy, xhat, rstd.view(-1, 1), w, want_w, xhat=xhat)
    else:
        m, n = y.shape
        unit = torch.ones(m, 1, dtype=acc, device=y.device)
        b_acc = bias.to(acc) if want_bias and bias is not None else None
        grad_s, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            dy, xhat, [n], unit.new_zeros(m, 1), unit, w, b_acc, [True, want_w, b_acc is not None])
        r = rstd.view(-1, 1).to(acc)
        if grad_sum is not None and grad_sum.dtype == acc:  # scale and add the sum's gradient in one pass
            grad_s, grad_sum = torch.addcmul(grad_sum, grad_s, r, out=grad_s), None
        else:
            grad_s = grad_s.mul_(r)
    if rms or grad_b is None:
        grad_b = grad_y.sum(0, dtype=acc) if want_bias and bias is not None else None
    grad_s = grad_s.to(y.dtype)
    grad_w = grad_w.to(weight.dtype) if want_w else None
    grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
    return _add_sum(grad_s, grad_sum), grad_w, grad_b


def _rms_bwd_from_output(grad_y, y, rstd, weight, weight_offset, want_weight, grad_sum, acc):
    # RMSNorm without a bias, from y = w * xhat: g * xhat = (dy * w) * (y / w) = dy * y, so the row term and the
    # weight gradient need no xhat at all; ds = rstd * (dy * w - xhat * mean(dy * y)) with xhat = y * (1 / w).
    # Nine small ops where the general form takes eleven (host time is most of a small norm's step)
    w = weight.to(acc)
    if weight_offset:
        w = w + weight_offset
    dy = grad_y.to(acc)
    p = dy * y  # a bf16/fp16 y promotes to fp32 on the way, here and below
    inv = w.reciprocal()
    # the row sum, its 1 / N folded into addcmul's value (mean() is a sum and a division: twice the time)
    ds = torch.addcmul(dy * w, y * inv, p.sum(-1, keepdim=True), value=-1.0 / max(y.shape[-1], 1)).mul_(rstd.view(-1, 1))
    grad_w = p.sum(0).mul_(inv).to(weight.dtype) if want_weight else None
    return _add_sum(ds, grad_sum).to(y.dtype), grad_w, None  # the sum's gradient added in acc: one rounding


def _add_sum(grad_s, grad_sum):
    return grad_s if grad_sum is None else grad_s.add_(grad_sum)


# --------------------------------------------------------------------------- Triton kernels
if triton is not None:

    @triton.jit
    def _norm_fwd_kernel(
        X,  # pointer to the (M, N) input
        RES,  # pointer to the (M, N) residual (unused unless HAS_RES)
        SUM,  # pointer to the (M, N) sum x + residual, written when HAS_RES
        Y,  # pointer to the (M, N) output
        W,  # pointer to the (N,) weight (unused unless HAS_W)
        B,  # pointer to the (N,) bias (unused unless HAS_B)
        MEAN,  # pointer to the (M,) fp32 row means (unused when RMS)
        RSTD,  # pointer to the (M,) fp32 row 1 / sqrt(var + eps)
        N,  # columns
        EPS,  # variance epsilon
        W_OFFSET,  # added to the weight: 1.0 for Gemma's (1 + weight)
        HAS_RES: tl.constexpr,  # add the residual first and store the sum
        HAS_W: tl.constexpr,  # elementwise affine weight
        HAS_B: tl.constexpr,  # bias
        RMS: tl.constexpr,  # RMSNorm (no mean subtraction) instead of LayerNorm
        BLOCK: tl.constexpr,  # columns per program, >= N
    ):
        # Bytes per row: read x (and residual) N*s each, write y (and the sum) N*s each, 4-8 bytes of stats:
        # 2Ns (norm) or 4Ns (add + norm); eager's add + norm moves 5Ns.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0)
        if HAS_RES:
            s = (x.to(tl.float32) + tl.load(RES + row * N + cols, mask=mask, other=0.0).to(tl.float32))
            s = s.to(SUM.dtype.element_ty)  # one rounding to the input dtype, as eager's add
            tl.store(SUM + row * N + cols, s, mask=mask)
            x = s
        x = x.to(tl.float32)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=0) / N
            tl.store(MEAN + row, mean)
            xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + EPS)
        tl.store(RSTD + row, rstd)
        y = xc * rstd
        if HAS_W:
            y = y * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + W_OFFSET)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_bwd_kernel(
        DY,  # pointer to the (M, N) upstream gradient of y
        DSUM,  # pointer to the (M, N) upstream gradient of the sum (unused unless HAS_DSUM)
        S,  # pointer to the (M, N) saved normalised input (the sum with a residual), or the output when FROM_Y
        W,  # pointer to the (N,) weight (unused unless HAS_W)
        B,  # pointer to the (N,) bias (read only when SUB_B)
        MEAN,  # pointer to the (M,) fp32 row means (unused when RMS)
        RSTD,  # pointer to the (M,) fp32 row rstd
        DS,  # pointer to the (M, N) gradient w.r.t. s (output)
        DW_PART,  # pointer to the (cdiv(M, ROWS), N) fp32 partial weight gradients (unused unless HAS_W)
        DB_PART,  # pointer to the (cdiv(M, ROWS), N) fp32 partial bias gradients (unused unless HAS_B)
        M,  # rows
        N,  # columns
        W_OFFSET,  # added to the weight
        HAS_DSUM: tl.constexpr,  # add the sum's own gradient to ds
        HAS_W: tl.constexpr,  # weight present
        HAS_B: tl.constexpr,  # bias present
        RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
        FROM_Y: tl.constexpr,  # S holds the output y: xhat = (y - b) / w (output_recoverable said it is safe)
        SUB_B: tl.constexpr,  # FROM_Y with a bias to subtract
        ROWS: tl.constexpr,  # rows per program
        BLOCK: tl.constexpr,  # columns per program, >= N
    ):
        # Bytes per row: read dy, s (and dsum) 2-3 Ns, write ds Ns; partials add 4-8 N bytes per ROWS rows.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + W_OFFSET
        if SUB_B:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.full([BLOCK], 0.0, tl.float32)
        db = tl.full([BLOCK], 0.0, tl.float32)
        for r in range(ROWS):
            row = pid.to(tl.int64) * ROWS + r
            mask = cmask & (row * N + cols < M * N)  # a vector mask: the interpreter rejects scalar ones
            s = tl.load(S + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            stat = tl.minimum(row, M - 1)  # rows past M read a real statistic; their dy is 0 so they add 0
            rstd = tl.load(RSTD + stat)
            if FROM_Y:
                xhat = s - b if SUB_B else s
                xhat = tl.where(mask, xhat / w, 0.0) if HAS_W else xhat
            elif RMS:
                xhat = s * rstd
            else:
                xhat = tl.where(mask, (s - tl.load(MEAN + stat)) * rstd, 0.0)
            g = dy * w if HAS_W else dy
            c1 = tl.sum(xhat * g, axis=0) / N
            if RMS:
                ds = (g - xhat * c1) * rstd
            else:
                ds = (g - xhat * c1 - tl.sum(g, axis=0) / N) * rstd
            if HAS_DSUM:
                ds += tl.load(DSUM + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DS + row * N + cols, ds.to(DS.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        if HAS_W:
            tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw, mask=cmask)
        if HAS_B:
            tl.store(DB_PART + pid.to(tl.int64) * N + cols, db, mask=cmask)


def _fwd_triton(x, weight, bias, residual, eps, rms, weight_offset):
    # x (..., N) contiguous: rows are rows whatever the leading dims, and y and the sum keep x's shape
    n = x.shape[-1]
    m = math.prod(x.shape[:-1])
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    mean = torch.empty(m if not rms else 0, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if x.numel():
        block, warps = calculate_settings(n)
        _norm_fwd_kernel[(m,)](
            x, residual if residual is not None else x, s, y, weight if weight is not None else x,
            bias if bias is not None else x, mean if not rms else rstd, rstd, n, eps, float(weight_offset),
            HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms,
            BLOCK=block, num_warps=warps)
    return y, s, None if rms else mean, rstd


def _bwd_triton(grad_y, s, mean, rstd, weight, rms, weight_offset, has_bias, grad_sum, want_weight, from_y=False,
                bias=None):
    # from_y: s is the output y (norm_bwd_from_output), bias the one to subtract; has_bias: its gradient is wanted
    m, n = s.shape
    grad_s = torch.empty_like(s)
    want_w = weight is not None and want_weight
    new = torch.empty if m else torch.zeros  # column_sum writes every column of a non-empty batch
    grad_w = new(n, dtype=weight.dtype, device=s.device) if want_w else None
    grad_b = new(n, dtype=weight.dtype if weight is not None else s.dtype, device=s.device) if has_bias else None
    if s.numel():
        block, warps = calculate_settings(n)
        groups = triton.cdiv(m, _ROWS)
        dw = torch.empty(groups, n, dtype=torch.float32, device=s.device) if want_w else grad_s
        db = torch.empty(groups, n, dtype=torch.float32, device=s.device) if has_bias else grad_s
        _norm_bwd_kernel[(groups,)](
            grad_y, grad_sum if grad_sum is not None else grad_y, s, weight if weight is not None else s,
            bias if bias is not None else s, mean if mean is not None else rstd, rstd, grad_s, dw, db, m, n,
            float(weight_offset), HAS_DSUM=grad_sum is not None, HAS_W=weight is not None, HAS_B=has_bias, RMS=rms,
            FROM_Y=from_y, SUB_B=from_y and bias is not None, ROWS=_ROWS, BLOCK=block, num_warps=warps)
        for part, out in ((dw, grad_w), (db, grad_b)):
            if out is not None:
                column_sum(part, out)
    return grad_s, grad_w, grad_b


def uses_triton(t: torch.Tensor) -> bool:
    """Whether ``norm_fwd`` / ``norm_bwd`` run the Triton kernels for ``t`` (else the torch path)."""
    return backend_for(t) == "triton" and t.shape[-1] <= _MAX_BLOCK


def _check_param(name, p, x):
    if p is None:
        return None
    check_tensor(name, p, dtypes=_FLOATS, dim=1, device=x.device)
    if p.shape[0] != x.shape[1]:
        raise ValueError(f"{name} must have {x.shape[1]} elements (x's last dim), got {p.shape[0]}")
    return p.contiguous()


def norm_fwd(x, weight=None, bias=None, residual=None, eps=1e-5, rms=False, weight_offset=0.0, check=True):
    """LayerNorm (``rms=False``) or RMSNorm of ``x [+ residual]`` over the last dim.

    x, residual: (M, N) of one float dtype (made contiguous); weight, bias: (N,) or None. Returns
    ``(y, s, mean, rstd)``: y and s (M, N) in x's dtype, ``s = x + residual`` (``x`` itself without a
    residual); mean (M,) fp32 (None for RMSNorm) and rstd (M,) fp32, the only statistics backward needs.
    ``check=False`` skips argument validation (for callers that validated already: it is per-call overhead) and
    takes ``(..., N)`` as well: y and s keep x's shape, the statistics are per row, ``(M,)``.
    """
    if not check:
        if uses_triton(x):
            return _fwd_triton(x.contiguous(), weight, bias, None if residual is None else residual.contiguous(),
                               eps, rms, weight_offset)
        return norm_fwd_reference(x, weight, bias, residual, eps, rms, weight_offset)
    check_tensor("x", x, dtypes=_FLOATS, dim=2)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), dim=2, device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        residual = residual.contiguous()
    weight, bias = _check_param("weight", weight, x), _check_param("bias", bias, x)
    x = x.contiguous()
    if uses_triton(x):
        return _fwd_triton(x, weight, bias, residual, eps, rms, weight_offset)
    return norm_fwd_reference(x, weight, bias, residual, eps, rms, weight_offset)


def norm_bwd(grad_y, s, mean, rstd, weight=None, rms=False, weight_offset=0.0, has_bias=False, grad_sum=None,
             want_weight=True, bias=None, check=True):
    """Gradients of ``norm_fwd`` from its saved ``s``, ``mean``, ``rstd``.

    grad_y, grad_sum: (M, N) in s's dtype (grad_sum: the gradient of the sum output, or None). Returns
    ``(grad_s, grad_weight, grad_bias)``: grad_s (M, N) is the gradient of both x and residual; grad_weight
    and grad_bias (N,) (None when absent / not wanted), reduced in a fixed order.
    """
    if check:
        _check_bwd(grad_y, s)
    if grad_sum is not None:
        grad_sum = grad_sum.contiguous()
    if uses_triton(s):
        return _bwd_triton(grad_y.contiguous(), s.contiguous(), mean, rstd, weight, rms, weight_offset, has_bias,
                           grad_sum, want_weight)
    return norm_bwd_reference(grad_y, s, mean, rstd, weight, rms, weight_offset, has_bias, grad_sum, want_weight,
                              bias)


def norm_bwd_from_output(grad_y, y, rstd, weight=None, bias=None, rms=False, weight_offset=0.0, want_weight=True,
                         want_bias=True, grad_sum=None, check=True):
    """Gradients of ``norm_fwd`` from its output ``y`` and ``rstd`` instead of its input.

    ``xhat = (y - bias) / (weight + weight_offset)``: valid where ``output_recoverable`` says so (the caller
    decides, at run time, and saves the input otherwise). Saving ``y`` costs nothing extra when the next op
    (a Linear) saves it anyway. Returns ``(grad_s, grad_weight, grad_bias)`` as ``norm_bwd``; ``check=False``
    as there.
    """
    if check:
        _check_bwd(grad_y, y)
    if grad_sum is not None:
        grad_sum = grad_sum.contiguous()
    if uses_triton(y):
        return _bwd_triton(grad_y.contiguous(), y.contiguous(), None, rstd, weight, rms, weight_offset,
                           want_bias and bias is not None, grad_sum, want_weight, from_y=True, bias=bias)
    return norm_bwd_from_output_reference(grad_y, y, rstd, weight, bias, rms, weight_offset, want_weight,
                                          want_bias, grad_sum)


def _check_bwd(grad_y, s):
    check_tensor("s", s, dtypes=_FLOATS, dim=2)
    check_tensor("grad_y", grad_y, dtypes=(s.dtype,), dim=2, device=s.device)
    if grad_y.shape != s.shape:
        raise ValueError(f"grad_y must have s's shape {tuple(s.shape)}, got {tuple(grad_y.shape)}")
