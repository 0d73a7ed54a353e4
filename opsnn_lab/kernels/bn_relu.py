"""BatchNorm statistics + normalize + ReLU (+ max-pool): Triton kernels, launchers and torch reference."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from opsnn_lab.kernels._dispatch import _interpreting, backend_for, calculate_settings

__all__ = ["PoolSpec", "window_index", "flat_index", "bn_relu_forward", "bn_relu_backward", "bn_relu_forward_torch",
           "bn_relu_backward_torch", "bn_relu_forward_triton", "bn_relu_backward_triton"]

_CHUNK = 1024  # elements of one channel per program in the reductions (stage 1 of the two-stage sums)
tl = None  # triton.language, bound on first kernel build so importing this file never imports triton


@dataclass(frozen=True)
class PoolSpec:
    """A max-pool window: kernel, stride, padding as (h, w); dilation 1, floor mode."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        return ((h + 2 * self.padding[0] - self.kernel[0]) // self.stride[0] + 1,
                (w + 2 * self.padding[1] - self.kernel[1]) // self.stride[1] + 1)

    def args(self) -> tuple[list[int], list[int], list[int]]:
        return list(self.kernel), list(self.stride), list(self.padding)

    @property
    def sentinel(self) -> int:
        """Window index stored where the pooled max is <= 0: ReLU made it 0, so no gradient flows."""
        return self.kernel[0] * self.kernel[1]


def _scale_shift(channels, weight, bias, mean, invstd, device):
    """Per-channel fp32 (scale, shift) so that ``bn(y) = y * scale + shift``; None stats mean identity."""
    one = torch.ones(channels, device=device, dtype=torch.float32)
    scale = one if invstd is None else invstd.float()
    if weight is not None:
        scale = scale * weight.float()
    shift = torch.zeros_like(one) if bias is None else bias.float().clone()
    if mean is not None:
        shift = shift - mean.float() * scale
    return scale, shift


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


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _planes_inner(t: torch.Tensor, cl: bool) -> torch.Tensor:
    """A view whose logical order is its memory order: (N, OH, OW, C) for channels-last, else itself."""
    return t.permute(0, 2, 3, 1) if cl else t.contiguous()


def _bcast(plane: torch.Tensor, cl: bool) -> torch.Tensor:
    return plane.unsqueeze(-1) if cl else plane


def window_index(flat: torch.Tensor, pooled: torch.Tensor, height: int, width: int, spec: PoolSpec) -> torch.Tensor:
    """aten's int64 plane indices -> uint8 within-window index (``spec.sentinel`` where pooled <= 0).

    Consumes ``flat``; the result has the layout of ``flat`` (channels-last stays channels-last).
    """
    origin, to_window, _, _ = _index_tables(spec, height, width, flat.device)
    cl = _channels_last(flat)
    k = torch.take(to_window, _planes_inner(flat, cl).sub_(_bcast(origin, cl)))
    k.masked_fill_(_planes_inner(pooled, cl) <= 0, spec.sentinel)
    return k.permute(0, 3, 1, 2) if cl else k


def flat_index(idx: torch.Tensor, height: int, width: int, spec: PoolSpec) -> torch.Tensor:
    """uint8 within-window index -> int64 plane index, layout of ``idx`` (the sentinel -> an in-plane cell)."""
    _, _, to_plane, row = _index_tables(spec, height, width, idx.device)
    cl = _channels_last(idx)
    pos = _planes_inner(idx, cl) + _bcast(row, cl)  # uint8 + int32 -> int32 in one pass
    flat = torch.index_select(to_plane, 0, pos.view(-1)).view(pos.shape)
    return flat.permute(0, 3, 1, 2) if cl else flat


# ----------------------------------------------------------------------------------------------- torch path
def bn_relu_forward_torch(y, weight, bias, running_mean, running_var, *, training, momentum, eps, pool=None):
    """Reference of :func:`bn_relu_forward` (the CPU fast path: aten batch-norm + in-place ReLU + pool)."""
    if training:
        z, mean, invstd = torch.ops.aten.native_batch_norm(y, weight, bias, running_mean, running_var,
                                                           True, momentum, eps)
    else:
        invstd = None if running_var is None else torch.rsqrt(running_var.float() + eps)
        mean = running_mean
        if weight is None and bias is None and mean is None and invstd is None:
            z = y if pool is not None else y.relu()
        else:
            scale, shift = _scale_shift(y.shape[1], weight, bias, mean, invstd, y.device)
            z = torch.addcmul(shift.view(-1, 1, 1), y, scale.view(-1, 1, 1)).to(y.dtype)
    if pool is None:
        return z.relu_(), mean, invstd, None
    # max-pool commutes with ReLU (monotone; the first maximum wins either way when it is > 0), so the
    # ReLU runs on the pooled tensor, a quarter of the size for a 3/2 pool.
    out, flat = torch.ops.aten.max_pool2d_with_indices(z, *pool.args(), [1, 1], False)
    idx = window_index(flat, out, y.shape[-2], y.shape[-1], pool)
    return out.relu_(), mean, invstd, idx


def _relu_grad_torch(grad_out, y, weight, bias, mean, invstd, idx, pool, in_shape, like):
    if pool is None:
        scale, shift = _scale_shift(y.shape[1], weight, bias, mean, invstd, y.device)
        # fp32 by type promotion, then rounded as the forward output was, so the mask is eager's.
        a = torch.addcmul(shift.view(-1, 1, 1), y, scale.view(-1, 1, 1)).to(grad_out.dtype)
        # Eager ReLU's own backward op, written over ``a`` (element-wise, so safe): one full-size buffer less.
        return torch.ops.aten.threshold_backward.grad_input(grad_out, a, 0, grad_input=a)
    # Zero the sentinel windows and move to the index's layout in one pass.
    masked = torch.empty(idx.shape, dtype=grad_out.dtype, device=idx.device,
                         memory_format=torch.channels_last if _channels_last(idx) else torch.contiguous_format)
    grad_out = torch.where(idx == pool.sentinel, grad_out.new_zeros(()), grad_out, out=masked)
    flat = flat_index(idx, in_shape[-2], in_shape[-1], pool)
    if like is None:  # only its shape and layout are read; never touched, so never paged in
        like = torch.empty(in_shape, dtype=grad_out.dtype, device=idx.device,
                           memory_format=torch.channels_last if _channels_last(idx) else torch.contiguous_format)
    return torch.ops.aten.max_pool2d_with_indices_backward(grad_out, like, *pool.args(), [1, 1], False, flat)


def bn_relu_backward_torch(grad_out, y, weight, bias, mean, invstd, idx, *, training, eps, pool=None,
                           in_shape=None, output_mask=(True, True, True)):
    """Reference of :func:`bn_relu_backward`."""
    in_shape = tuple(y.shape) if y is not None else tuple(in_shape)
    g = _relu_grad_torch(grad_out, y, weight, bias, mean, invstd, idx, pool, in_shape, y)
    if training:
        return torch.ops.aten.native_batch_norm_backward(g, y, weight, None, None, mean, invstd, True, eps,
                                                         list(output_mask))
    if y is None or (weight is None and invstd is None):
        return g, None, None
    scale, _ = _scale_shift(y.shape[1], weight, None, None, invstd, y.device)
    xhat = (y.float() - (0 if mean is None else mean.float().view(-1, 1, 1))) * (invstd.float().view(-1, 1, 1))
    gw = (g.float() * xhat).sum((0, 2, 3)) if output_mask[1] else None
    gb = g.float().sum((0, 2, 3)) if output_mask[2] else None
    return (g * scale.view(-1, 1, 1).to(g.dtype)), gw, gb


# ---------------------------------------------------------------------------------------------- triton path
@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels; built per interpreter mode because triton picks the mode at decoration time."""
    global tl
    import triton
    import triton.language as language

    tl = language
    fns = (_stats_partial_kernel, _stats_finalize_kernel, _sum_chunks_kernel, _bn_relu_fwd_kernel,
           _bn_relu_pool_fwd_kernel, _bn_relu_bwd_kernel)
    return {f.__name__: triton.jit(f) for f in fns}


def _stats_partial_kernel(
    Y,  # pointer to the conv output, (N, C, H, W) with any strides
    PMEAN, PM2, PCOUNT,  # pointers to fp32 [C, NUM_CHUNKS] chunk mean, sum of squared deviations, count
    C, H, W, M,  # channels, plane height, plane width, elements per channel (N * H * W)
    s_n, s_c, s_h, s_w,  # strides of Y in elements
    NUM_CHUNKS,  # chunks per channel
    BLOCK: tl.constexpr,  # elements per chunk
):
    # Stage 1 of the statistics: reads N*C*H*W elements once, writes 3 * C * NUM_CHUNKS fp32.
    c = tl.program_id(0)
    j = tl.program_id(1)
    m = j * BLOCK + tl.arange(0, BLOCK)
    mask = m < M
    hw = H * W
    n = (m // hw).to(tl.int64)
    r = m % hw
    off = n * s_n + c * s_c + (r // W) * s_h + (r % W) * s_w
    y = tl.load(Y + off, mask=mask, other=0.0).to(tl.float32)
    count = tl.minimum(M - j * BLOCK, BLOCK).to(tl.float32)
    mean = tl.sum(y, axis=0) / count
    d = tl.where(mask, y - mean, 0.0)
    tl.store(PMEAN + c * NUM_CHUNKS + j, mean)
    tl.store(PM2 + c * NUM_CHUNKS + j, tl.sum(d * d, axis=0))
    tl.store(PCOUNT + c * NUM_CHUNKS + j, count)


def _stats_finalize_kernel(
    PMEAN, PM2, PCOUNT,  # pointers to fp32 [C, NUM_CHUNKS] partials from stage 1
    MEAN, INVSTD, VAR,  # pointers to fp32 [C] outputs: batch mean, 1/sqrt(biased var + eps), unbiased var
    NUM_CHUNKS,  # chunks per channel
    M,  # elements per channel
    eps,  # BatchNorm epsilon
    BLOCK_P: tl.constexpr,  # partials merged per step
):
    # Stage 2: Chan's parallel merge in a fixed order (no atomics, so bit-identical run to run).
    # Reads 3 * C * NUM_CHUNKS fp32 twice, writes 3 * C fp32.
    c = tl.program_id(0)
    base = c * NUM_CHUNKS
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for j0 in range(0, NUM_CHUNKS, BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        jm = j < NUM_CHUNKS
        acc += tl.load(PMEAN + base + j, mask=jm, other=0.0) * tl.load(PCOUNT + base + j, mask=jm, other=0.0)
    mean = tl.sum(acc, axis=0) / M
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for j0 in range(0, NUM_CHUNKS, BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        jm = j < NUM_CHUNKS
        d = tl.load(PMEAN + base + j, mask=jm, other=0.0) - mean
        acc += tl.load(PM2 + base + j, mask=jm, other=0.0) + tl.load(PCOUNT + base + j, mask=jm, other=0.0) * d * d
    m2 = tl.sum(acc, axis=0)
    tl.store(MEAN + c, mean)
    tl.store(INVSTD + c, 1.0 / tl.sqrt(m2 / M + eps))
    tl.store(VAR + c, m2 / tl.maximum(M - 1, 1))


def _sum_chunks_kernel(
    P,  # pointer to fp32 [C, NUM_CHUNKS] partial sums
    OUT,  # pointer to fp32 [C] totals
    NUM_CHUNKS,  # chunks per channel
    BLOCK_P: tl.constexpr,  # partials summed per step
):
    # Stage 2 of the BN weight/bias gradients: fixed-order sum. Reads C * NUM_CHUNKS fp32, writes C fp32.
    c = tl.program_id(0)
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for j0 in range(0, NUM_CHUNKS, BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        acc += tl.load(P + c * NUM_CHUNKS + j, mask=j < NUM_CHUNKS, other=0.0)
    tl.store(OUT + c, tl.sum(acc, axis=0))


def _bn_relu_fwd_kernel(
    Y,  # pointer to the conv output (N, C, H, W)
    OUT,  # pointer to relu(y * scale + shift), same shape
    SCALE, SHIFT,  # pointers to fp32 [C] folded affine
    H, W, M,  # plane height, plane width, elements per channel
    s_n, s_c, s_h, s_w,  # strides of Y
    o_n, o_c, o_h, o_w,  # strides of OUT
    BLOCK: tl.constexpr,  # elements per program
):
    # Element-wise: reads and writes N*C*H*W elements once each (2 x itemsize bytes per element).
    c = tl.program_id(0)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = m < M
    hw = H * W
    n = (m // hw).to(tl.int64)
    h = (m % hw) // W
    w = m % W
    y = tl.load(Y + n * s_n + c * s_c + h * s_h + w * s_w, mask=mask, other=0.0).to(tl.float32)
    z = tl.maximum(y * tl.load(SCALE + c) + tl.load(SHIFT + c), 0.0)
    tl.store(OUT + n * o_n + c * o_c + h * o_h + w * o_w, z.to(OUT.dtype.element_ty), mask=mask)


def _bn_relu_pool_fwd_kernel(
    Y,  # pointer to the conv output (N, C, H, W)
    OUT,  # pointer to the pooled output (N, C, OH, OW)
    IDX,  # pointer to uint8 within-window argmax (N, C, OH, OW), contiguous; KH * KW where out == 0
    SCALE, SHIFT,  # pointers to fp32 [C] folded affine
    C, H, W, OH, OW,  # channels, input plane, output plane
    s_n, s_c, s_h, s_w,  # strides of Y
    o_n, o_c, o_h, o_w,  # strides of OUT
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,  # window and stride
    PH: tl.constexpr, PW: tl.constexpr,  # padding
    BLOCK: tl.constexpr,  # outputs per program
):
    # Reads each input element ~ceil(K/S)^2 times from cache (~N*C*H*W from memory), writes the pooled
    # output and one uint8 per pooled element; the full-size ReLU output never reaches memory.
    nc = tl.program_id(0)
    n = (nc // C).to(tl.int64)
    c = nc % C
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o < OH * OW
    oh = o // OW
    ow = o % OW
    scale = tl.load(SCALE + c)
    shift = tl.load(SHIFT + c)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK], dtype=tl.int32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            h = oh * SH - PH + kh
            w = ow * SW - PW + kw
            ok = mask & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            y = tl.load(Y + n * s_n + c * s_c + h * s_h + w * s_w, mask=ok, other=0.0).to(tl.float32)
            # Round to the output dtype before comparing, so ties break as eager's pool over the stored ReLU.
            a = (y * scale + shift).to(OUT.dtype.element_ty).to(tl.float32)
            a = tl.where(ok, a, float("-inf"))
            take = a > best  # strict: the first maximum wins, as in aten's max_pool2d
            best = tl.where(take, a, best)
            arg = tl.where(take, kh * KW + kw, arg)
    out = tl.maximum(best, 0.0)
    arg = tl.where(best > 0, arg, KH * KW)
    tl.store(OUT + n * o_n + c * o_c + oh * o_h + ow * o_w, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(IDX + nc.to(tl.int64) * OH * OW + o, arg.to(tl.uint8), mask=mask)


def _bn_relu_bwd_kernel(
    Y,  # pointer to the conv output (N, C, H, W); unread when NEED_Y is false
    G,  # pointer to the upstream gradient: (N, C, H, W), or (N, C, OH, OW) when POOL
    IDX,  # pointer to the uint8 within-window argmax (N, C, OH, OW) when POOL
    GY,  # pointer to the gradient written in PHASE 1, strides as Y's
    PG, PGX,  # pointers to fp32 [C, NUM_CHUNKS] partial sums of g and g * xhat (PHASE 0)
    SCALE, SHIFT, MEAN, INVSTD,  # pointers to fp32 [C]: forward affine, batch mean and 1/std
    CA, CB, CD,  # pointers to fp32 [C]: PHASE 1 writes CA * g + CB * xhat + CD
    H, W, OH, OW, M, NUM_CHUNKS,  # input plane, pooled plane, elements per channel, chunks per channel
    s_n, s_c, s_h, s_w,  # strides of Y and GY
    g_n, g_c, g_h, g_w,  # strides of G
    i_n, i_c, i_h, i_w,  # strides of IDX
    POOL: tl.constexpr, NEED_Y: tl.constexpr, PHASE: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,  # pool window, stride
    PH: tl.constexpr, PW: tl.constexpr,  # pool padding
    NH: tl.constexpr, NW: tl.constexpr,  # windows that can cover one element: ceil(KH / SH), ceil(KW / SW)
    BLOCK: tl.constexpr,  # elements of one channel per program
):
    # g = dL/d(pre-ReLU) is recomputed in both phases instead of stored: with POOL it is gathered from the
    # <= ceil(K/S)^2 windows that can point at an element (a gather, so no atomics), else masked by the
    # recomputed ReLU. PHASE 0 reads y + grad (N*C*H*W*2 itemsize, pooled grad 1/S^2 of that) and writes
    # 2 * C * NUM_CHUNKS fp32; PHASE 1 reads the same and writes N*C*H*W itemsize.
    c = tl.program_id(0)
    j = tl.program_id(1)
    m = j * BLOCK + tl.arange(0, BLOCK)
    mask = m < M
    hw = H * W
    n = (m // hw).to(tl.int64)
    h = (m % hw) // W
    w = m % W
    y_off = n * s_n + c * s_c + h * s_h + w * s_w
    if NEED_Y:
        y = tl.load(Y + y_off, mask=mask, other=0.0).to(tl.float32)
    else:
        y = tl.zeros([BLOCK], dtype=tl.float32)
    if POOL:
        g = tl.zeros([BLOCK], dtype=tl.float32)
        for ih in tl.static_range(NH):
            oh = (h + PH) // SH - (NH - 1 - ih)  # ascending window order, as aten's scatter adds them
            kh = h + PH - oh * SH
            for iw in tl.static_range(NW):
                ow = (w + PW) // SW - (NW - 1 - iw)
                kw = w + PW - ow * SW
                ok = mask & (oh >= 0) & (oh < OH) & (kh < KH) & (ow >= 0) & (ow < OW) & (kw < KW)
                k = tl.load(IDX + n * i_n + c * i_c + oh * i_h + ow * i_w, mask=ok, other=KH * KW).to(tl.int32)
                hit = ok & (k == kh * KW + kw)
                g += tl.load(G + n * g_n + c * g_c + oh * g_h + ow * g_w, mask=hit, other=0.0).to(tl.float32)
    else:
        g = tl.load(G + n * g_n + c * g_c + h * g_h + w * g_w, mask=mask, other=0.0).to(tl.float32)
        a = y * tl.load(SCALE + c) + tl.load(SHIFT + c)
        g = tl.where(a > 0, g, 0.0)
    xhat = (y - tl.load(MEAN + c)) * tl.load(INVSTD + c)
    if PHASE == 0:
        tl.store(PG + c * NUM_CHUNKS + j, tl.sum(g, axis=0))
        tl.store(PGX + c * NUM_CHUNKS + j, tl.sum(tl.where(mask, g * xhat, 0.0), axis=0))
    else:
        gy = tl.load(CA + c) * g + tl.load(CB + c) * xhat + tl.load(CD + c)
        tl.store(GY + y_off, gy.to(GY.dtype.element_ty), mask=mask)


def _strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


def _pool_consts(pool: PoolSpec | None) -> dict:
    k, s, p = (pool.kernel, pool.stride, pool.padding) if pool else ((1, 1), (1, 1), (0, 0))
    return {"KH": k[0], "KW": k[1], "SH": s[0], "SW": s[1], "PH": p[0], "PW": p[1]}


def _batch_stats_triton(k, y: torch.Tensor, eps: float):
    """Two-stage per-channel mean, 1/std and unbiased variance of ``y`` (fp32 [C] each)."""
    n, c, h, w = y.shape
    m = n * h * w
    block, warps = calculate_settings(min(m, _CHUNK))
    chunks = _cdiv(m, block)
    part = torch.empty(3, c, chunks, device=y.device, dtype=torch.float32)
    k["_stats_partial_kernel"][(c, chunks)](y, part[0], part[1], part[2], c, h, w, m, *_strides4(y), chunks,
                                           BLOCK=block, num_warps=warps)
    stats = torch.empty(3, c, device=y.device, dtype=torch.float32)
    block_p, warps_p = calculate_settings(min(chunks, _CHUNK))
    k["_stats_finalize_kernel"][(c,)](part[0], part[1], part[2], stats[0], stats[1], stats[2], chunks, m, eps,
                                      BLOCK_P=block_p, num_warps=warps_p)
    return stats[0], stats[1], stats[2]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bn_relu_forward_triton(y, weight, bias, running_mean, running_var, *, training, momentum, eps, pool=None):
    """Triton version of :func:`bn_relu_forward` (stats in fp32, returned as fp32)."""
    k = _kernels(_interpreting())
    n, c, h, w = y.shape
    if training:
        mean, invstd, var = _batch_stats_triton(k, y, eps)
        if running_mean is not None:
            running_mean.copy_(mean * momentum + running_mean.float() * (1 - momentum))
            running_var.copy_(var * momentum + running_var.float() * (1 - momentum))
    else:
        mean = running_mean
        invstd = None if running_var is None else torch.rsqrt(running_var.float() + eps)
    scale, shift = _scale_shift(c, weight, bias, mean, invstd, y.device)
    if pool is None:
        out = torch.empty_like(y)
        block, warps = calculate_settings(min(n * h * w, _CHUNK))
        grid = (c, _cdiv(n * h * w, block))
        k["_bn_relu_fwd_kernel"][grid](y, out, scale, shift, h, w, n * h * w, *_strides4(y), *_strides4(out),
                                       BLOCK=block, num_warps=warps)
        return out, mean, invstd, None
    oh, ow = pool.out_size(h, w)
    fmt = torch.channels_last if y.is_contiguous(memory_format=torch.channels_last) and c > 1 else None
    out = torch.empty(n, c, oh, ow, device=y.device, dtype=y.dtype, memory_format=fmt or torch.contiguous_format)
    idx = torch.empty(n, c, oh, ow, device=y.device, dtype=torch.uint8)
    block, warps = calculate_settings(min(oh * ow, _CHUNK))
    k["_bn_relu_pool_fwd_kernel"][(n * c, _cdiv(oh * ow, block))](
        y, out, idx, scale, shift, c, h, w, oh, ow, *_strides4(y), *_strides4(out), **_pool_consts(pool),
        BLOCK=block, num_warps=warps)
    return out, mean, invstd, idx


def bn_relu_backward_triton(grad_out, y, weight, bias, mean, invstd, idx, *, training, eps, pool=None,
                            in_shape=None, output_mask=(True, True, True)):
    """Triton version of :func:`bn_relu_backward`; BN weight/bias grads by two-stage fixed-order sums."""
    k = _kernels(_interpreting())
    n, c, h, w = tuple(y.shape) if y is not None else tuple(in_shape)
    m = n * h * w
    dev = grad_out.device
    scale, shift = _scale_shift(c, weight, bias, mean, invstd, dev)
    zero = torch.zeros(c, device=dev, dtype=torch.float32)
    mean32 = zero if mean is None else mean.float()
    inv32 = torch.ones_like(zero) if invstd is None else invstd.float()
    need_y = y is not None and (pool is None or training or output_mask[1])
    like = y if y is not None else grad_out
    gy = torch.empty_like(y) if y is not None else torch.empty(n, c, h, w, device=dev, dtype=grad_out.dtype)
    block, warps = calculate_settings(min(m, _CHUNK))
    chunks = _cdiv(m, block)
    part = torch.empty(2, c, chunks, device=dev, dtype=torch.float32)
    idx_t = idx if idx is not None else grad_out
    pc = _pool_consts(pool)
    cover = dict(NH=_cdiv(pc["KH"], pc["SH"]), NW=_cdiv(pc["KW"], pc["SW"]))
    common = dict(POOL=pool is not None, NEED_Y=need_y, BLOCK=block, num_warps=warps, **pc, **cover)
    ph = pool.out_size(h, w) if pool else (h, w)

    def launch(phase, ca, cb, cd):
        k["_bn_relu_bwd_kernel"][(c, chunks)](
            like, grad_out, idx_t, gy, part[0], part[1], scale, shift, mean32, inv32, ca, cb, cd,
            h, w, ph[0], ph[1], m, chunks, *_strides4(gy), *_strides4(grad_out), *_strides4(idx_t),
            PHASE=phase, **common)

    gw = gb = None
    if training or (weight is not None and any(output_mask[1:])):
        launch(0, zero, zero, zero)
        sums = torch.empty(2, c, device=dev, dtype=torch.float32)
        block_p, warps_p = calculate_settings(min(chunks, _CHUNK))
        for i in range(2):
            k["_sum_chunks_kernel"][(c,)](part[i], sums[i], chunks, BLOCK_P=block_p, num_warps=warps_p)
        gb, gw = sums[0], sums[1]
    a_coef = inv32 * (1.0 if weight is None else weight.float())
    if training:
        launch(1, a_coef, -a_coef * gw / m, -a_coef * gb / m)
    else:
        launch(1, a_coef, zero, zero)
    cast = lambda t, on: None if t is None or not on or weight is None else t.to(weight.dtype)
    return gy, cast(gw, output_mask[1]), cast(gb, output_mask[2])


# ------------------------------------------------------------------------------------------------ dispatch
def bn_relu_forward(y, weight, bias, running_mean, running_var, *, training, momentum, eps, pool=None):
    """``relu(batch_norm(y))`` then max-pool when ``pool`` is given.

    y: (N, C, H, W) float; weight/bias: [C] or None (identity affine); running_mean/running_var: [C]
    buffers, updated in place with ``momentum`` (the effective factor, as F.batch_norm) when ``training``,
    read when not (None: no normalisation). Returns ``(out, mean, invstd, idx)``: out (N, C, H, W), or
    (N, C, OH, OW) with pool; mean/invstd [C] (batch stats in training); idx uint8 within-window argmax
    (``pool.sentinel`` where the pooled value is 0) or None.
    """
    if backend_for(y) == "triton":
        return bn_relu_forward_triton(y, weight, bias, running_mean, running_var, training=training,
                                      momentum=momentum, eps=eps, pool=pool)
    return bn_relu_forward_torch(y, weight, bias, running_mean, running_var, training=training,
                                 momentum=momentum, eps=eps, pool=pool)


def bn_relu_backward(grad_out, y, weight, bias, mean, invstd, idx, *, training, eps, pool=None, in_shape=None,
                     output_mask=(True, True, True)):
    """Gradients of :func:`bn_relu_forward` -> ``(grad_y, grad_weight, grad_bias)``.

    grad_out: like the forward output; y: the saved (N, C, H, W) conv output (may be None in eval with a
    pool, then ``in_shape`` gives its shape); mean/invstd as returned by the forward; idx: the uint8 window
    index. ``output_mask`` says which of the three gradients are needed (None where not).
    """
    if backend_for(grad_out, y) == "triton":
        return bn_relu_backward_triton(grad_out, y, weight, bias, mean, invstd, idx, training=training, eps=eps,
                                       pool=pool, in_shape=in_shape, output_mask=output_mask)
    return bn_relu_backward_torch(grad_out, y, weight, bias, mean, invstd, idx, training=training, eps=eps,
                                  pool=pool, in_shape=in_shape, output_mask=output_mask)
