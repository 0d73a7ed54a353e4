"""BatchNorm + pointwise activation (+ max-pool): activation table, torch reference path, and backend dispatch.

A PReLU (UVDoc's and face-recognition nets' Conv -> BN -> PReLU) is ``leaky_relu`` with a learned slope: pass its
weight as ``slope`` ([1] or [C]; no pool, since a learned slope need not keep max-pool commuting); backward then
returns the slope's gradient as a fourth value, ``sum(g * z)`` where ``z <= 0``, as aten's ``_prelu_kernel_backward``.
"""

from __future__ import annotations

import functools

import torch

from opsnn_lab.kernels._dispatch import backend_for
from opsnn_lab.kernels.bn_act_spec import ACTS, RELU, Act, PoolSpec, scale_shift, slope_view

__all__ = ["Act", "ACTS", "RELU", "PoolSpec", "window_index", "flat_index", "scale_shift", "acc_dtype",
           "bn_act_forward", "bn_act_backward", "bn_act_forward_torch", "bn_act_backward_torch", "prelu_forward",
           "prelu_backward"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics and the affine are computed in: fp32 for fp32/bf16/fp16 (widened), fp64 for fp64
    (an fp32 scale would put ~1e-8 relative error into an fp64 model's outputs and gradients)."""
    return torch.promote_types(dtype, torch.float32)


@functools.lru_cache(maxsize=32)
def _index_tables(spec: PoolSpec, height: int, width: int, device: torch.device):
    """Tables that make each index conversion one gather (int64 arithmetic on the pooled tensor is slow).

    Window ``o`` covers plane cells ``origin[o] + kh * W + kw``. ``to_window[kh * W + kw] = kh * KW + kw``;
    ``to_plane[o * (KK + 1) + k]`` is the plane cell of window ``o``, cell ``k``, and for ``k = KK`` (the
    sentinel) an in-plane cell of that window, so no clamping is needed. ``row`` holds ``o * (KK + 1)``.
    """
    (kh, kw), (sh, sw), (ph, pw) = spec.kernel, spec.stride, spec.padding
    oh, ow = spec.out_size(height, width)
    h0 = torch.arange(oh, dtype=torch.int64).view(-1, 1) * sh - ph
    w0 = torch.arange(ow, dtype=torch.int64).view(1, -1) * sw - pw
    origin = h0 * width + w0
    rel = (torch.arange(kh).view(-1, 1) * width + torch.arange(kw).view(1, -1)).flatten()
    to_window = torch.full((int(rel.max()) + 1,), spec.sentinel, dtype=torch.uint8)
    to_window[rel] = torch.arange(kh * kw, dtype=torch.uint8)
    safe = h0.clamp(0, height - 1) * width + w0.clamp(0, width - 1)  # window start, clamped into the plane
    to_plane = torch.cat([(origin.unsqueeze(-1) + rel), safe.unsqueeze(-1)], dim=-1)
    row = torch.arange(oh * ow, dtype=torch.int32).view(oh, ow) * (kh * kw + 1)
    return origin.to(device), to_window.to(device), to_plane.flatten().to(device), row.to(device)


def channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _planes_inner(t: torch.Tensor, cl: bool) -> torch.Tensor:
    """A view whose logical order is its memory order: (N, OH, OW, C) for channels-last, else itself."""
    return t.permute(0, 2, 3, 1) if cl else t.contiguous()


def _bcast(plane: torch.Tensor, cl: bool) -> torch.Tensor:
    return plane.unsqueeze(-1) if cl else plane


def window_index(flat: torch.Tensor, dead: torch.Tensor | None, height: int, width: int,
                 spec: PoolSpec) -> torch.Tensor:
    """aten's int64 plane indices -> uint8 within-window index (``spec.sentinel`` where ``dead`` is True).

    Consumes ``flat``; the result has the layout of ``flat`` (channels-last stays channels-last).
    """
    origin, to_window, _, _ = _index_tables(spec, height, width, flat.device)
    cl = channels_last(flat)
    k = torch.take(to_window, _planes_inner(flat, cl).sub_(_bcast(origin, cl)))
    if dead is not None:
        k.masked_fill_(_planes_inner(dead, cl), spec.sentinel)
    return k.permute(0, 3, 1, 2) if cl else k


def flat_index(idx: torch.Tensor, height: int, width: int, spec: PoolSpec) -> torch.Tensor:
    """uint8 within-window index -> int64 plane index, layout of ``idx`` (the sentinel -> an in-plane cell)."""
    _, _, to_plane, row = _index_tables(spec, height, width, idx.device)
    cl = channels_last(idx)
    pos = _planes_inner(idx, cl) + _bcast(row, cl)  # uint8 + int32 -> int32 in one pass
    flat = torch.index_select(to_plane, 0, pos.view(-1)).view(pos.shape)
    return flat.permute(0, 3, 1, 2) if cl else flat


# ----------------------------------------------------------------------------------------------- torch path
def _scale_shift(y, weight, bias, mean, invstd):
    """:func:`scale_shift` in ``acc_dtype(y.dtype)``."""
    return scale_shift(y.shape[1], weight, bias, mean, invstd, y.device, acc_dtype(y.dtype))


def _affine(y, weight, bias, mean, invstd, dtype):
    """``bn(y) = y * scale + shift`` in ``acc_dtype(y.dtype)``, rounded to ``dtype`` as eager stores it.

    Written as an eval-mode batch norm with mean 0, variance 1 and eps 0 (so ``y * scale + shift`` exactly, the
    same bits as an fp32 ``addcmul`` then a cast): aten's per-channel kernel does it in one vectorised pass,
    ~4x faster on CPU than ``addcmul`` with broadcast [C, 1, 1] operands (2.5 ms vs 10 ms for 8x144x56x56 fp32).
    """
    scale, shift = _scale_shift(y, weight, bias, mean, invstd)
    if y.dtype != dtype:
        return torch.addcmul(shift.view(-1, 1, 1), y, scale.view(-1, 1, 1)).to(dtype)
    return torch.batch_norm(y, scale, shift, torch.zeros_like(scale), torch.ones_like(scale), False, 0.0, 0.0, False)


# The one-pass variance E[y^2] - mean^2 loses about (1 + mean^2 / var) ulps: a channel whose mean lies over
# 4 standard deviations out (past ~1e-6 relative) is taken again in two fp64 passes; past an eighth of the
# channels, aten's kernel takes the whole tensor.
_MAX_MEAN_SQ_OVER_VAR = 16.0
_MAX_RETAKEN = 0.125


def _one_pass_stats(y: torch.Tensor):
    """Per-channel fp64 (mean, biased variance) of a contiguous (N, C, H, W) ``y`` from two row reductions.

    aten's CPU batch-norm statistics of a contiguous tensor run ~5x slower than a row sum plus a row norm (7 ms
    vs 1.4 ms for an 8x144x56x56 fp32 tensor on one core): the sums and sums of squares are taken along each
    (n, c) plane in fp32 and combined over the batch in fp64, as accurate as aten's fp32 results (mean within
    ~3e-8 of a standard deviation, variance ~2e-7 relative) while the mean stays within 4 standard
    deviations. Channels past that are taken again, centered, in fp64. Returns None (the caller then uses
    aten's statistics) off the CPU, for another layout (channels-last: aten is fast there, and the column
    reductions are not), for a dtype other than fp32 (fp64; and bf16/fp16, whose ``sum(dtype=fp32)`` and norm
    convert the whole tensor first: two full copies, which made a bf16-autocast MobileNetV2 step 1.36x eager's
    where aten's kernel reads bf16 in its one pass), non-finite values, or too many channels to take again.
    """
    if y.device.type != "cpu" or y.dtype != torch.float32 or not y.is_contiguous():
        return None
    if torch.are_deterministic_algorithms_enabled():  # strict(): aten's, whose bits no thread count moves
        return None
    n, c = y.shape[:2]
    count = y.numel() // c
    planes = y.view(n, c, -1)
    total = planes.sum(-1, dtype=torch.float32).double().sum(0)
    squares = torch.linalg.vector_norm(planes, dim=-1, dtype=torch.float32).double().square().sum(0)
    if not bool(torch.isfinite(squares).all()):  # inf or NaN in y, or squares past fp32's range
        return None
    mean = total / count
    var = (squares / count - mean.square()).clamp_min(0)
    cancelled = mean.square() > _MAX_MEAN_SQ_OVER_VAR * var  # finite here: the check above saw to that
    if bool(cancelled.any()):
        retake = cancelled.nonzero().squeeze(1)
        if retake.numel() > _MAX_RETAKEN * c:
            return None
        part = planes.index_select(1, retake).double()
        part_mean = part.mean((0, 2))
        mean[retake] = part_mean
        var[retake] = (part - part_mean.view(1, -1, 1)).square().mean((0, 2))
    return mean, var


# Below this many elements aten's statistics are faster: the row reductions cost ~20 small ops and two host
# reads (~80 us on one core whatever the size) against aten's one op (~1.5 ns an element); measured crossover
# between 65k (rows 1.2x aten's time) and 197k elements (0.8x) on a Xeon with AVX-512, one thread. Small models
# and small batches (MobileNetV2 at 32x32) have most of their BatchNorms below it.
ROW_STATS_MIN_ELEMENTS = 1 << 17


def _train_stats(y, running_mean, running_var, momentum, eps):
    """Batch (mean, invstd) as fp32 [C], the running statistics updated as ``F.batch_norm`` does; None when
    ``y`` is small (:data:`ROW_STATS_MIN_ELEMENTS`) or :func:`_one_pass_stats` declines."""
    if y.numel() < ROW_STATS_MIN_ELEMENTS:
        return None
    stats = _one_pass_stats(y)
    if stats is None:
        return None
    mean, var = stats
    if running_mean is not None:
        count = y.numel() // y.shape[1]
        unbiased = var * (count / (count - 1)) if count > 1 else var
        running_mean.copy_(running_mean.double() * (1 - momentum) + mean * momentum)
        running_var.copy_(running_var.double() * (1 - momentum) + unbiased * momentum)
    acc = acc_dtype(y.dtype)  # fp32: _one_pass_stats declines fp64
    return mean.to(acc), (var + eps).rsqrt().to(acc)


def prelu_forward(z: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """``prelu(z, slope)`` with aten's kernel, in the slope's dtype (autocast's, where the caller cast it)."""
    return torch._prelu_kernel(z.to(slope.dtype), slope_view(slope, z))


def prelu_backward(grad: torch.Tensor, z: torch.Tensor, slope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dL/dz, dL/dslope)`` of ``prelu(z, slope)`` with aten's kernel; the slope's gradient in its own shape."""
    view = slope_view(slope, z)
    gz, gs = torch.ops.aten._prelu_kernel_backward(grad, z.to(slope.dtype), view)
    return gz, gs.sum_to_size(view.shape).view(slope.shape)


def bn_act_forward_torch(y, weight, bias, running_mean, running_var, *, training, momentum, eps, act=RELU,
                         pool=None, slope=None):
    """Reference of :func:`bn_act_forward` (the CPU fast path: batch statistics from row reductions, aten's for
    small tensors; aten's per-channel affine, the eager activation and pool)."""
    stats = _train_stats(y, running_mean, running_var, momentum, eps) if training else None
    if stats is not None:
        mean, invstd = stats
        z = _affine(y, weight, bias, mean, invstd, y.dtype)
        # saved in the dtype aten's batch-norm gives them (its backward asks for it): the parameters', else y's
        params = weight if weight is not None else running_mean
        dtype = y.dtype if params is None else params.dtype
        mean, invstd = mean.to(dtype), invstd.to(dtype)
    elif training:
        z, mean, invstd = torch.ops.aten.native_batch_norm(y, weight, bias, running_mean, running_var,
                                                           True, momentum, eps)
    else:
        invstd = None if running_var is None else torch.rsqrt(running_var.to(acc_dtype(y.dtype)) + eps)
        mean = running_mean
        if weight is None and bias is None and mean is None and invstd is None:
            z = y  # the caller may keep y for backward: nothing below writes into it
        else:
            z = _affine(y, weight, bias, mean, invstd, y.dtype)
    inplace = z is not y
    if slope is not None:
        return prelu_forward(z, slope), mean, invstd, None
    if pool is None:
        return act.forward(z, inplace), mean, invstd, None
    if act.monotone:
        # max-pool commutes with a non-decreasing activation (the first maximum wins either way where the
        # derivative is not 0), so it runs on the pooled tensor, a quarter of the size for a 3/2 pool.
        out, flat = torch.ops.aten.max_pool2d_with_indices(z, *pool.args(), [1, 1], False)
        out = act.forward(out, True)
    else:
        out, flat = torch.ops.aten.max_pool2d_with_indices(act.forward(z, inplace), *pool.args(), [1, 1], False)
    dead = act.dead(out) if act.has_dead_zone else None
    idx = window_index(flat, dead, y.shape[-2], y.shape[-1], pool)
    return out, mean, invstd, idx


def _unpool(grad_out, idx, pool, in_shape, like):
    """Scatter the pooled gradient back to the input plane (sentinel windows get nothing)."""
    fmt = torch.channels_last if channels_last(idx) else torch.contiguous_format
    # Zero the sentinel windows and move to the index's layout in one pass.
    masked = torch.empty(idx.shape, dtype=grad_out.dtype, device=idx.device, memory_format=fmt)
    grad_out = torch.where(idx == pool.sentinel, grad_out.new_zeros(()), grad_out, out=masked)
    flat = flat_index(idx, in_shape[-2], in_shape[-1], pool)
    if like is None:  # only its shape and layout are read; never touched, so never paged in
        like = torch.empty(in_shape, dtype=grad_out.dtype, device=idx.device, memory_format=fmt)
    return torch.ops.aten.max_pool2d_with_indices_backward(grad_out, like, *pool.args(), [1, 1], False, flat)


def _act_grad_torch(grad_out, y, weight, bias, mean, invstd, idx, pool, in_shape, act, slope=None):
    """dL/d(pre-activation), the pre-activation recomputed from ``y`` and the statistics (with ``slope``: and the
    PReLU slope's gradient, as a pair)."""
    if pool is not None:
        g = _unpool(grad_out, idx, pool, in_shape, y)
        if act.has_dead_zone:  # the sentinel already zeroed every window whose derivative is 0
            return g
        grad_out = g
    # Rounded as the forward output was, so the derivative is taken where eager's was.
    z = _affine(y, weight, bias, mean, invstd, grad_out.dtype)
    if slope is not None:
        gz, gs = prelu_backward(grad_out, z, slope)
        return gz.to(y.dtype), gs
    if z.stride() != grad_out.stride():
        z = z.contiguous(memory_format=torch.channels_last if channels_last(grad_out) else torch.contiguous_format)
    return act.backward_(grad_out, z)  # one full-size buffer, reused for the result


def bn_act_backward_torch(grad_out, y, weight, bias, mean, invstd, idx, *, training, eps, act=RELU, pool=None,
                          in_shape=None, output_mask=(True, True, True), slope=None):
    """Reference of :func:`bn_act_backward`."""
    if slope is not None:
        g, gs = _act_grad_torch(grad_out, y, weight, bias, mean, invstd, idx, pool, None, act, slope)
        return (*_bn_backward(g, y, weight, mean, invstd, training, eps, output_mask), gs)
    in_shape = tuple(y.shape) if y is not None else tuple(in_shape)
    g = _act_grad_torch(grad_out, y, weight, bias, mean, invstd, idx, pool, in_shape, act)
    return _bn_backward(g, y, weight, mean, invstd, training, eps, output_mask)


def _bn_backward(g, y, weight, mean, invstd, training, eps, output_mask):
    """``(grad_y, grad_weight, grad_bias)`` of the batch norm from the pre-activation's gradient ``g``."""
    if training:
        return torch.ops.aten.native_batch_norm_backward(g, y, weight, None, None, mean, invstd, True, eps,
                                                         list(output_mask))
    if y is None or (weight is None and invstd is None):
        return g, None, None
    acc = acc_dtype(y.dtype)
    scale, _ = _scale_shift(y, weight, None, None, invstd)
    xhat = (y.to(acc) - (0 if mean is None else mean.to(acc).view(-1, 1, 1))) * (invstd.to(acc).view(-1, 1, 1))
    gw = (g.to(acc) * xhat).sum((0, 2, 3)) if output_mask[1] else None
    gb = g.to(acc).sum((0, 2, 3)) if output_mask[2] else None
    return (g * scale.view(-1, 1, 1).to(g.dtype)), gw, gb


# ------------------------------------------------------------------------------------------------ dispatch
def bn_act_forward(y, weight, bias, running_mean, running_var, *, training, momentum, eps, act=RELU, pool=None,
                   slope=None):
    """``act(batch_norm(y))`` then max-pool when ``pool`` is given.

    y: (N, C, H, W) float; weight/bias: [C] or None (identity affine); running_mean/running_var: [C]
    buffers, updated in place with ``momentum`` (the effective factor, as F.batch_norm) when ``training``,
    read when not (None: no normalisation); act: an :class:`Act`. Returns ``(out, mean, invstd, idx)``:
    out (N, C, H, W), or (N, C, OH, OW) with pool, dtype of y; mean/invstd [C] (batch stats in training);
    idx uint8 (N, C, OH, OW) within-window argmax (``pool.sentinel`` where ``act.dead``) or None. With ``slope``
    (a PReLU's weight, no pool) the activation is that PReLU, run in the slope's dtype.
    """
    if pool is not None and slope is not None:
        raise ValueError("a PReLU slope takes no pool: a learned slope need not keep max-pool commuting")
    if backend_for(y) == "triton":
        from opsnn_lab.kernels.bn_act_triton import bn_act_forward_triton

        return bn_act_forward_triton(y, weight, bias, running_mean, running_var, training=training,
                                     momentum=momentum, eps=eps, act=act, pool=pool, slope=slope)
    return bn_act_forward_torch(y, weight, bias, running_mean, running_var, training=training,
                                momentum=momentum, eps=eps, act=act, pool=pool, slope=slope)


def bn_act_backward(grad_out, y, weight, bias, mean, invstd, idx, *, training, eps, act=RELU, pool=None,
                    in_shape=None, output_mask=(True, True, True), slope=None):
    """Gradients of :func:`bn_act_forward` -> ``(grad_y, grad_weight, grad_bias)``.

    grad_out: like the forward output; y: the saved (N, C, H, W) conv output (may be None in eval with a
    pool and an activation with a dead zone: then ``in_shape`` gives its shape); mean/invstd as returned by
    the forward; idx: the uint8 window index. ``output_mask`` says which of the three gradients are needed
    (None where not). grad_y has y's dtype; grad_weight/grad_bias weight's dtype in training,
    ``acc_dtype(y.dtype)`` in eval. With ``slope``: ``(grad_y, grad_weight, grad_bias, grad_slope)``.
    """
    kw = dict(training=training, eps=eps, act=act, pool=pool, in_shape=in_shape, output_mask=output_mask,
              slope=slope)
    if backend_for(grad_out, y) == "triton":
        from opsnn_lab.kernels.bn_act_triton import bn_act_backward_triton

        return bn_act_backward_triton(grad_out, y, weight, bias, mean, invstd, idx, **kw)
    return bn_act_backward_torch(grad_out, y, weight, bias, mean, invstd, idx, **kw)
