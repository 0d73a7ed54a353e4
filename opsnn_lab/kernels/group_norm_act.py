"""GroupNorm + pointwise activation: the torch path, the Triton kernels and the backend dispatch.

``act(group_norm(x))`` as diffusion UNets and VAEs (GroupNorm -> SiLU before every conv of a ResNet block), wav2vec2's
feature encoder (GroupNorm -> GELU) and ConvNeXt-style nets write it. Saved for backward: x and one fp32
(mean, 1/std) per (sample, group); the normalised tensor is recomputed (eager keeps it for the activation).

PReLU (MONAI's UNet: InstanceNorm -> PReLU) is ``leaky_relu`` with a learned slope, one or one per channel: pass its
weight as ``slope`` (``act`` is then ``Act("leaky_relu")``, its scalar slope unused); backward returns the slope's
gradient as a fourth value, ``sum(g * z)`` over the elements where ``z <= 0``, as aten's ``_prelu_kernel_backward``.
The PReLU runs in the slope's dtype, on the normalised values rounded to x's dtype and then to it: autocast runs
``prelu`` in its own dtype (the caller casts the slope), so the output has the slope's dtype.

Torch path: ``torch.native_group_norm`` then the activation in place; the backward recomputes the normalised
values (``x * scale + shift`` per channel, as aten's kernel forms them) and hands the activation's gradient to
``native_group_norm_backward``. Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``): one launch for the
statistics, one for the normalised activation; in backward, one launch of per-(sample, channel) sums, then one
for the input gradient; the weight and bias gradients and the per-group sums are fixed-order torch sums over
those [N, C] partials (no atomics: the same bits at every run).
"""

from __future__ import annotations

import functools
import math

import torch

from opsnn_lab.kernels._dispatch import _interpreting, backend_for, calculate_settings, cdiv
from opsnn_lab.kernels.bn_act import acc_dtype, prelu_backward, prelu_forward
from opsnn_lab.kernels.bn_act_spec import Act, slope_args

__all__ = ["group_norm_act_forward", "group_norm_act_backward", "group_norm_act_forward_torch",
           "group_norm_act_backward_torch"]

_CHUNK = 1024  # elements per program of the element-wise kernels and per step of the loops
tl = None  # triton.language, bound on first kernel build
_act_fwd = _act_grad = None  # bn_act_triton's jitted activation helpers, bound on first kernel build


def _scale_shift(weight, bias, mean, rstd, n, c, groups, acc):
    """Per (sample, channel) ``scale = rstd * w``, ``shift = b - mean * scale`` ([N, C], ``acc`` dtype)."""
    rstd_c = rstd.to(acc).view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
    mean_c = mean.to(acc).view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
    scale = rstd_c * weight.to(acc) if weight is not None else rstd_c
    shift = -mean_c * scale
    if bias is not None:
        shift = shift + bias.to(acc)
    return scale, shift


def _normalised(x, weight, bias, mean, rstd, groups):
    """The forward's ``group_norm(x)`` from its statistics, rounded to x's dtype (what the activation read)."""
    n, c = x.shape[:2]
    scale, shift = _scale_shift(weight, bias, mean, rstd, n, c, groups, acc_dtype(x.dtype))
    view = (n, c) + (1,) * (x.dim() - 2)
    # one pass in the statistics' dtype (addcmul promotes), one allocation: the backward's only extra pass over x
    return torch.addcmul(shift.view(view), x, scale.view(view)).to(x.dtype)


# --------------------------------------------------------------------------- torch path
def group_norm_act_forward_torch(x, weight, bias, groups: int, eps: float, act: Act, slope=None):
    """``(act(group_norm(x)), mean, rstd)``; mean and rstd as ``native_group_norm`` returns them ([N, G])."""
    n, c = x.shape[:2]
    y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, math.prod(x.shape[2:]), groups, eps)
    if slope is not None:
        return prelu_forward(y, slope), mean, rstd
    return act.forward(y, inplace=True), mean, rstd


def group_norm_act_backward_torch(grad_out, x, weight, bias, mean, rstd, groups: int, act: Act, need=(True,) * 3,
                                  slope=None):
    """``(grad_x, grad_weight, grad_bias, grad_slope)`` (None where ``need`` says so or there is no such tensor)."""
    n, c = x.shape[:2]
    z = _normalised(x, weight, bias, mean, rstd, groups)
    gs = None
    if slope is not None:
        gy, gs = prelu_backward(grad_out, z, slope)
        gy, gs = gy.to(x.dtype), gs if _needs(need, 3) else None
    else:
        gy = act.backward_(grad_out.contiguous(), z)
    mask = [need[0], need[1] and weight is not None, need[2] and bias is not None]
    gx, gw, gb = torch.ops.aten.native_group_norm_backward(gy, x, mean, rstd, weight, n, c,
                                                           math.prod(x.shape[2:]), groups, mask)
    return gx, gw, gb, gs


def _needs(need, i: int) -> bool:
    return len(need) <= i or bool(need[i])


# --------------------------------------------------------------------------- Triton kernels
@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels; the activation helpers are bn_act_triton's (one formula per activation)."""
    global tl, _act_fwd, _act_grad
    import triton
    import triton.language as language

    from opsnn_lab.kernels import bn_act_triton

    bn_act_triton._kernels(interpret)
    tl, _act_fwd, _act_grad = language, bn_act_triton._act_fwd, bn_act_triton._act_grad
    return {f.__name__: triton.jit(f) for f in (_gn_stats_kernel, _gn_act_fwd_kernel, _gn_sums_kernel,
                                                _gn_act_bwd_kernel)}


def _gn_stats_kernel(
    X,  # pointer to x, contiguous (N, C, *): group (n, g) is D contiguous elements from (n * G + g) * D
    MEAN, RSTD,  # pointers to fp32 [N * G]
    D, eps,  # elements per group, epsilon
    BLOCK: tl.constexpr,
):
    # Two passes over the group (mean, then the squared deviations): reads 2 * D elements per program.
    row = tl.program_id(0)
    base = row.to(tl.int64) * D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        acc += tl.load(X + base + d, mask=d < D, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        v = tl.load(X + base + d, mask=d < D, other=0.0).to(tl.float32)
        acc += tl.where(d < D, (v - mean) * (v - mean), 0.0)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps))


def _gn_act_fwd_kernel(
    X, OUT,  # pointers to x and the output, contiguous (N, C, *)
    SCALE, SHIFT,  # pointers to fp32 [N * C]: rstd * w and b - mean * rstd * w
    SLOPE, SLOPES, HW, C, PER_CHANNEL,  # leaky_relu slope; PReLU's fp32 slopes (1 or C); plane size, channels
    ACT: tl.constexpr, PRELU: tl.constexpr, BLOCK: tl.constexpr,
):
    # Element-wise over one (sample, channel) plane: reads and writes HW elements once each.
    nc = tl.program_id(0)
    if PRELU:
        SLOPE = tl.load(SLOPES + (nc % C) * PER_CHANNEL)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = h < HW
    off = nc.to(tl.int64) * HW + h
    x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    z = (x * tl.load(SCALE + nc) + tl.load(SHIFT + nc)).to(X.dtype.element_ty)  # as stored, then as the act reads it
    z = z.to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + off, _act_fwd(z, SLOPE, ACT).to(OUT.dtype.element_ty), mask=mask)


def _gn_sums_kernel(
    G, X,  # pointers to the upstream gradient and x, contiguous (N, C, *)
    SCALE, SHIFT, MEAN, RSTD,  # fp32 [N * C] affine; fp32 [N * G] statistics
    SG, SGX,  # pointers to fp32 [N * C]: sum over the plane of g and of g * xhat (g: the activation's gradient)
    SGS,  # PReLU: pointer to fp32 [N * C], the sum over the plane of the upstream gradient * z where z <= 0
    SLOPE, SLOPES, HW, CG, C, PER_CHANNEL,  # slope, PReLU's slopes, plane size, channels per group, channels
    ACT: tl.constexpr, PRELU: tl.constexpr, BLOCK: tl.constexpr,
):
    # One (sample, channel) plane per program, in a fixed order: reads 2 * HW elements.
    nc = tl.program_id(0)
    if PRELU:
        SLOPE = tl.load(SLOPES + (nc % C) * PER_CHANNEL)
    grp = nc // CG
    scale, shift = tl.load(SCALE + nc), tl.load(SHIFT + nc)
    mean, rstd = tl.load(MEAN + grp), tl.load(RSTD + grp)
    acc_g = tl.zeros([BLOCK], dtype=tl.float32)
    acc_gx = tl.zeros([BLOCK], dtype=tl.float32)
    acc_gs = tl.zeros([BLOCK], dtype=tl.float32)
    for h0 in range(0, HW, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        mask = h < HW
        off = nc.to(tl.int64) * HW + h
        x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
        z = (x * scale + shift).to(X.dtype.element_ty).to(G.dtype.element_ty).to(tl.float32)
        up = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
        g = tl.where(mask, _act_grad(up, z, SLOPE, ACT), 0.0)
        acc_g += g
        acc_gx += g * (x - mean) * rstd
        if PRELU:
            acc_gs += tl.where(mask & (z <= 0), up * z, 0.0)
    tl.store(SG + nc, tl.sum(acc_g, axis=0))
    tl.store(SGX + nc, tl.sum(acc_gx, axis=0))
    if PRELU:
        tl.store(SGS + nc, tl.sum(acc_gs, axis=0))


def _gn_act_bwd_kernel(
    G, X, GX,  # pointers to the upstream gradient, x and the input gradient (written), contiguous (N, C, *)
    SCALE, SHIFT, MEAN, RSTD, W,  # fp32 [N * C] affine, fp32 [N * G] statistics, the [C] weight (HAS_W)
    A, B,  # fp32 [N * G]: sum of w * g and of w * g * xhat over the group, divided by its size
    SLOPE, SLOPES, HW, CG, C, PER_CHANNEL,
    ACT: tl.constexpr, HAS_W: tl.constexpr, PRELU: tl.constexpr, BLOCK: tl.constexpr,
):
    # dx = rstd * (w * g - A - xhat * B): reads 2 * HW, writes HW elements per program.
    nc = tl.program_id(0)
    if PRELU:
        SLOPE = tl.load(SLOPES + (nc % C) * PER_CHANNEL)
    grp = nc // CG
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = h < HW
    off = nc.to(tl.int64) * HW + h
    mean, rstd = tl.load(MEAN + grp), tl.load(RSTD + grp)
    x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    z = (x * tl.load(SCALE + nc) + tl.load(SHIFT + nc)).to(X.dtype.element_ty).to(G.dtype.element_ty).to(tl.float32)
    g = _act_grad(tl.load(G + off, mask=mask, other=0.0).to(tl.float32), z, SLOPE, ACT)
    if HAS_W:
        g = g * tl.load(W + nc % C).to(tl.float32)
    dx = rstd * (g - tl.load(A + grp) - (x - mean) * rstd * tl.load(B + grp))
    tl.store(GX + off, dx.to(GX.dtype.element_ty), mask=mask)


def _launch_block(hw: int) -> tuple[int, int]:
    return calculate_settings(max(1, min(hw, _CHUNK)))


def group_norm_act_forward_triton(x, weight, bias, groups: int, eps: float, act: Act, slope=None):
    k = _kernels(_interpreting())
    x = x.contiguous()
    n, c = x.shape[:2]
    hw = math.prod(x.shape[2:])
    d = c // groups * hw
    stats = torch.empty(2, n, groups, device=x.device, dtype=torch.float32)
    mean, rstd = stats[0], stats[1]
    out = torch.empty_like(x, dtype=slope.dtype if slope is not None else x.dtype)
    if x.numel():
        block, warps = _launch_block(d)
        k["_gn_stats_kernel"][(n * groups,)](x, mean, rstd, d, eps, BLOCK=block, num_warps=warps)
        scale, shift = _scale_shift(weight, bias, mean, rstd, n, c, groups, torch.float32)
        block, warps = _launch_block(hw)
        slopes, per_channel = slope_args(slope, x)
        k["_gn_act_fwd_kernel"][(n * c, cdiv(hw, block))](x, out, scale, shift, act.negative_slope, slopes, hw, c,
                                                          per_channel, ACT=act.code, PRELU=slope is not None,
                                                          BLOCK=block, num_warps=warps)
    return out, mean, rstd


def group_norm_act_backward_triton(grad_out, x, weight, bias, mean, rstd, groups: int, act: Act,
                                   need=(True,) * 3, slope=None):
    k = _kernels(_interpreting())
    x, grad_out = x.contiguous(), grad_out.contiguous()
    n, c = x.shape[:2]
    hw = math.prod(x.shape[2:])
    cg = c // groups
    gx = torch.empty_like(x) if need[0] else None
    prelu = slope is not None
    if not x.numel():
        zeros = torch.zeros(c, device=x.device, dtype=torch.float32)
        gs = torch.zeros_like(slope) if prelu and _needs(need, 3) else None
        return gx, _param_grad(zeros, weight, need[1]), _param_grad(zeros, bias, need[2]), gs
    scale, shift = _scale_shift(weight, bias, mean, rstd, n, c, groups, torch.float32)
    sums = torch.empty(3 if prelu else 2, n, c, device=x.device, dtype=torch.float32)
    block, warps = _launch_block(hw)
    slopes, per_channel = slope_args(slope, x)
    k["_gn_sums_kernel"][(n * c,)](grad_out, x, scale, shift, mean, rstd, sums[0], sums[1], sums[-1],
                                   act.negative_slope, slopes, hw, cg, c, per_channel, ACT=act.code, PRELU=prelu,
                                   BLOCK=block, num_warps=warps)
    sg, sgx = sums[0], sums[1]
    if need[0]:
        w = weight.float() if weight is not None else torch.ones(c, device=x.device)
        size = cg * hw
        a = (sg * w).view(n, groups, cg).sum(-1).div_(size)  # fixed-order sums over the group's channels
        b = (sgx * w).view(n, groups, cg).sum(-1).div_(size)
        k["_gn_act_bwd_kernel"][(n * c, cdiv(hw, block))](
            grad_out, x, gx, scale, shift, mean, rstd, weight if weight is not None else scale, a, b,
            act.negative_slope, slopes, hw, cg, c, per_channel, ACT=act.code, HAS_W=weight is not None, PRELU=prelu,
            BLOCK=block, num_warps=warps)
    gs = None
    if prelu and _needs(need, 3):  # fixed-order sums of the per-plane partials: over samples, then channels if one
        gs = sums[2].sum(0) if per_channel else sums[2].sum()
        gs = gs.view(slope.shape).to(slope.dtype)
    return gx, _param_grad(sgx.sum(0), weight, need[1]), _param_grad(sg.sum(0), bias, need[2]), gs


def _param_grad(total, param, needed):
    return total.to(param.dtype) if needed and param is not None else None


# --------------------------------------------------------------------------- dispatch
def _triton(x) -> bool:
    return backend_for(x) == "triton" and x.dtype != torch.float64  # the kernels compute in fp32


def group_norm_act_forward(x, weight, bias, groups: int, eps: float, act: Act, slope=None):
    """``(act(group_norm(x, groups, weight, bias, eps)), mean, rstd)``: x (N, C, *) float, C divisible by
    ``groups``; mean and rstd fp32-or-wider [N, G], what backward reads besides x. With ``slope`` (a PReLU's
    weight, 1 or C values) the activation is that PReLU."""
    if _triton(x):
        return group_norm_act_forward_triton(x, weight, bias, groups, eps, act, slope)
    return group_norm_act_forward_torch(x, weight, bias, groups, eps, act, slope)


def group_norm_act_backward(grad_out, x, weight, bias, mean, rstd, groups: int, act: Act, need=(True,) * 4,
                            slope=None):
    """``(grad_x, grad_weight, grad_bias, grad_slope)`` of :func:`group_norm_act_forward`, the normalised values
    recomputed; ``need`` as the four are wanted (a fourth entry missing: wanted)."""
    if _triton(x):
        return group_norm_act_backward_triton(grad_out, x, weight, bias, mean, rstd, groups, act, need, slope)
    return group_norm_act_backward_torch(grad_out, x, weight, bias, mean, rstd, groups, act, need, slope)
