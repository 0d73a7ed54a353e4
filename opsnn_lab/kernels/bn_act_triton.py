"""BatchNorm + pointwise activation (+ max-pool) as Triton kernels: atomic-free, fixed-order two-stage sums."""

from __future__ import annotations

import functools

import torch

from opsnn_lab.kernels._dispatch import _interpreting, calculate_settings, cdiv
from opsnn_lab.kernels.bn_act_spec import RELU, Act, PoolSpec, scale_shift, slope_args

__all__ = ["bn_act_forward_triton", "bn_act_backward_triton"]

_CHUNK = 1024  # elements of one channel per program in the reductions (stage 1 of the two-stage sums)
tl = None  # triton.language, bound on first kernel build so importing this file never imports triton
_act_fwd = _act_grad = _softplus = _affine_of = _merge_stats = _grad_sums = _update_running = None  # bound on build
# Every kernel rounds each product and sum once, as torch ops do (no fused multiply-add): the statistics and the
# folded affine get the same bits whichever kernel computes them, and the backward recomputes the forward's
# pre-activation exactly.
_EXACT = {"enable_fp_fusion": False}
# At most this many chunks per channel, the kernel that uses the statistics (the forward's normalize, the
# backward's phase 1) merges the chunk partials itself instead of a separate [C]-sized launch: every program
# re-reads its channel's 2-3 x NUM_CHUNKS partials (from cache), one launch fewer each way. Small batches,
# where a launch's host time is most of the step, are the ones with few chunks.
_INLINE_CHUNKS = 128


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels; built per interpreter mode because triton picks the mode at decoration time."""
    global tl, _act_fwd, _act_grad, _softplus, _affine_of, _merge_stats, _grad_sums, _update_running
    import triton
    import triton.language as language

    tl = language
    _softplus = triton.jit(_softplus_src)
    _act_fwd, _act_grad = triton.jit(_act_fwd_src), triton.jit(_act_grad_src)
    _affine_of, _merge_stats, _grad_sums, _update_running = (
        triton.jit(_affine_of_src), triton.jit(_merge_stats_src), triton.jit(_grad_sums_src),
        triton.jit(_update_running_src))
    fns = (_stats_partial_kernel, _stats_finalize_kernel, _grad_coef_kernel, _bn_act_fwd_kernel,
           _bn_act_pool_fwd_kernel, _bn_act_bwd_kernel)
    return {f.__name__: triton.jit(f) for f in fns}


# Activation codes are the index in kernels.bn_act.ACTS: relu 0, relu6 1, leaky_relu 2, silu 3, hardswish 4,
# gelu 5 (erf), gelu_tanh 6, mish 7, elu 8 (alpha 1). Formulas as aten's CPU kernels, evaluated in fp32.
def _act_fwd_src(z, SLOPE, ACT: tl.constexpr):
    if ACT == 0:
        return tl.maximum(z, 0.0)
    elif ACT == 1:
        return tl.minimum(tl.maximum(z, 0.0), 6.0)
    elif ACT == 2:
        return tl.where(z > 0, z, z * SLOPE)
    elif ACT == 3:
        return z * tl.sigmoid(z)
    elif ACT == 4:
        return z * tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0
    elif ACT == 5:
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACT == 6:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        return 0.5 * z * (1.0 + 2.0 * tl.sigmoid(2.0 * inner) - 1.0)
    elif ACT == 7:
        return z * (2.0 * tl.sigmoid(2.0 * _softplus(z)) - 1.0)
    else:
        return tl.where(z > 0, z, tl.exp(tl.minimum(z, 0.0)) - 1.0)


def _softplus_src(z):
    return tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))


def _act_grad_src(g, z, SLOPE, ACT: tl.constexpr):
    # g * act'(z), with aten's conventions at the kinks (relu6: 0 at 0 and 6; hardswish: x/3 + 1/2 on [-3, 3]).
    if ACT == 0:
        return tl.where(z > 0, g, 0.0)
    elif ACT == 1:
        return tl.where((z > 0) & (z < 6.0), g, 0.0)
    elif ACT == 2:
        return tl.where(z > 0, g, g * SLOPE)
    elif ACT == 3:
        s = tl.sigmoid(z)
        return g * s * (1.0 + z * (1.0 - s))
    elif ACT == 4:
        return tl.where(z < -3.0, 0.0, tl.where(z <= 3.0, g * (z / 3.0 + 0.5), g))
    elif ACT == 5:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        return g * (cdf + z * pdf)
    elif ACT == 7:
        t = 2.0 * tl.sigmoid(2.0 * _softplus(z)) - 1.0
        return g * (t + z * tl.sigmoid(z) * (1.0 - t * t))
    elif ACT == 8:
        return tl.where(z > 0, g, g * tl.exp(tl.minimum(z, 0.0)))
    else:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        right = 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        return g * (0.5 * (1.0 + t) + right)


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
    MEAN, INVSTD,  # pointers to fp32 [C] outputs: batch mean, 1/sqrt(biased var + eps)
    W, B, SCALE, SHIFT,  # pointers to the [C] weight and bias (when HAS_W / HAS_B) and the fp32 folded affine
    RMEAN, RVAR,  # pointers to the [C] running statistics, updated in place when RUNNING
    NUM_CHUNKS,  # chunks per channel
    M,  # elements per channel
    eps,  # BatchNorm epsilon
    momentum, keep,  # running-statistics momentum and 1 - momentum (as the torch path rounds it)
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RUNNING: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partials merged per step
):
    # Stage 2: Chan's parallel merge in a fixed order (no atomics, so bit-identical run to run), then what
    # the torch path did in ~13 launches of [C]-sized ops: the folded affine and the running statistics.
    # Launched with enable_fp_fusion=False: every product and sum rounded once, as those torch ops round them.
    # Reads 3 * C * NUM_CHUNKS fp32 twice, writes 4-6 * C values.
    c = tl.program_id(0)
    mean, invstd, m2 = _merge_stats(PMEAN, PM2, PCOUNT, c, NUM_CHUNKS, M, eps, BLOCK_P)
    tl.store(MEAN + c, mean)
    tl.store(INVSTD + c, invstd)
    scale, shift = _affine_of(W, B, c, mean, invstd, HAS_W, HAS_B)
    tl.store(SCALE + c, scale)
    tl.store(SHIFT + c, shift)
    if RUNNING:
        _update_running(RMEAN, RVAR, c, mean, m2, M, momentum, keep)


def _merge_stats_src(PMEAN, PM2, PCOUNT, c, NUM_CHUNKS, M, eps, BLOCK_P: tl.constexpr):
    """Channel ``c``'s ``(mean, invstd, m2)`` from its chunk partials: Chan's merge in a fixed order."""
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
    return mean, 1.0 / tl.sqrt(m2 / M + eps), m2


def _update_running_src(RMEAN, RVAR, c, mean, m2, M, momentum, keep):
    """The running statistics of channel ``c``, updated in place (unbiased variance, as torch)."""
    var = m2 / tl.maximum(M - 1, 1)
    rm = tl.load(RMEAN + c).to(tl.float32)
    rv = tl.load(RVAR + c).to(tl.float32)
    tl.store(RMEAN + c, (mean * momentum + rm * keep).to(RMEAN.dtype.element_ty))
    tl.store(RVAR + c, (var * momentum + rv * keep).to(RVAR.dtype.element_ty))


def _affine_of_src(W, B, c, mean, invstd, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """``scale = invstd * w``, ``shift = b - mean * scale`` for channel ``c``, rounded as ``scale_shift``."""
    scale = invstd
    if HAS_W:
        scale = scale * tl.load(W + c).to(tl.float32)
    shift = tl.load(B + c).to(tl.float32) if HAS_B else 0.0
    return scale, shift - mean * scale


def _grad_sums_src(PG, PGX, c, NUM_CHUNKS, BLOCK_P: tl.constexpr):
    """Channel ``c``'s bias and weight gradients from phase 0's chunk partials, summed in a fixed order."""
    acc_g = tl.zeros([BLOCK_P], dtype=tl.float32)
    acc_gx = tl.zeros([BLOCK_P], dtype=tl.float32)
    for j0 in range(0, NUM_CHUNKS, BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        jm = j < NUM_CHUNKS
        acc_g += tl.load(PG + c * NUM_CHUNKS + j, mask=jm, other=0.0)
        acc_gx += tl.load(PGX + c * NUM_CHUNKS + j, mask=jm, other=0.0)
    return tl.sum(acc_g, axis=0), tl.sum(acc_gx, axis=0)


def _grad_coef_kernel(
    PG, PGX,  # pointers to fp32 [C, NUM_CHUNKS] partial sums of g and g * xhat (backward phase 0)
    W, INVSTD,  # pointers to the [C] weight (when HAS_W) and fp32 1/std
    GB, GW, CA, CB, CD,  # pointers to fp32 [C] outputs: bias and weight gradients, phase 1's coefficients
    NUM_CHUNKS,  # chunks per channel
    M,  # elements per channel
    HAS_W: tl.constexpr, TRAINING: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partials summed per step
):
    # Stage 2 of the BN weight/bias gradients (fixed-order sums, no atomics) and the coefficients of
    # gy = CA * g + CB * xhat + CD: CA = invstd * w; in training CB = -CA * gw / M and CD = -CA * gb / M.
    c = tl.program_id(0)
    gb, gw = _grad_sums(PG, PGX, c, NUM_CHUNKS, BLOCK_P)
    tl.store(GB + c, gb)
    tl.store(GW + c, gw)
    a = tl.load(INVSTD + c)
    if HAS_W:
        a = a * tl.load(W + c).to(tl.float32)
    tl.store(CA + c, a)
    if TRAINING:
        tl.store(CB + c, -a * gw / M)
        tl.store(CD + c, -a * gb / M)
    else:
        tl.store(CB + c, 0.0)
        tl.store(CD + c, 0.0)


def _bn_act_fwd_kernel(
    Y,  # pointer to the conv output (N, C, H, W)
    OUT,  # pointer to act(y * scale + shift), same shape
    SCALE, SHIFT,  # pointers to fp32 [C] folded affine (read unless FINAL)
    PMEAN, PM2, PCOUNT,  # FINAL: pointers to fp32 [C, NUM_CHUNKS] statistics partials (_stats_partial_kernel)
    MEAN, INVSTD,  # FINAL: pointers to fp32 [C] batch mean and 1/std, written by each channel's first program
    WT, BS, RMEAN, RVAR,  # FINAL: pointers to the [C] weight, bias and running statistics (per the flags)
    SLOPE,  # leaky_relu negative slope (unread by the other activations)
    SLOPES, PER_CHANNEL,  # PRELU: pointer to the fp32 slopes ([1] or [C]) and whether one per channel
    H, W, M, NUM_CHUNKS,  # plane height, plane width, elements per channel, statistics chunks per channel
    eps, momentum, keep,  # FINAL: BatchNorm epsilon, running-statistics momentum and 1 - momentum
    s_n, s_c, s_h, s_w,  # strides of Y
    o_n, o_c, o_h, o_w,  # strides of OUT
    ACT: tl.constexpr,  # activation code
    FINAL: tl.constexpr,  # merge the statistics partials here (_stats_finalize_kernel's work, per program)
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RUNNING: tl.constexpr,
    PRELU: tl.constexpr,  # the slope is channel c's PReLU weight (ACT is leaky_relu's code)
    BLOCK: tl.constexpr,  # elements per program
    BLOCK_P: tl.constexpr,  # partials merged per step (FINAL)
):
    # Element-wise: reads and writes N*C*H*W elements once each (2 x itemsize bytes per element); FINAL adds
    # 3 x NUM_CHUNKS fp32 per program, read twice (from cache after the channel's first program).
    c = tl.program_id(0)
    if FINAL:
        mean, invstd, m2 = _merge_stats(PMEAN, PM2, PCOUNT, c, NUM_CHUNKS, M, eps, BLOCK_P)
        scale, shift = _affine_of(WT, BS, c, mean, invstd, HAS_W, HAS_B)
        if tl.program_id(1) == 0:
            tl.store(MEAN + c, mean)
            tl.store(INVSTD + c, invstd)
            if RUNNING:
                _update_running(RMEAN, RVAR, c, mean, m2, M, momentum, keep)
    else:
        scale = tl.load(SCALE + c)
        shift = tl.load(SHIFT + c)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = m < M
    hw = H * W
    n = (m // hw).to(tl.int64)
    h = (m % hw) // W
    w = m % W
    y = tl.load(Y + n * s_n + c * s_c + h * s_h + w * s_w, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the storage dtype first: eager's activation reads the stored BN output.
    z = (y * scale + shift).to(Y.dtype.element_ty).to(OUT.dtype.element_ty).to(tl.float32)
    if PRELU:
        SLOPE = tl.load(SLOPES + c * PER_CHANNEL)
    a = _act_fwd(z, SLOPE, ACT)
    tl.store(OUT + n * o_n + c * o_c + h * o_h + w * o_w, a.to(OUT.dtype.element_ty), mask=mask)


def _bn_act_pool_fwd_kernel(
    Y,  # pointer to the conv output (N, C, H, W)
    OUT,  # pointer to the pooled output (N, C, OH, OW)
    IDX,  # pointer to uint8 within-window argmax (N, C, OH, OW), contiguous; KH * KW where act' is 0 (DEAD)
    SCALE, SHIFT,  # pointers to fp32 [C] folded affine
    SLOPE,  # leaky_relu negative slope
    C, H, W, OH, OW,  # channels, input plane, output plane
    s_n, s_c, s_h, s_w,  # strides of Y
    o_n, o_c, o_h, o_w,  # strides of OUT
    ACT: tl.constexpr,  # activation code
    MONOTONE: tl.constexpr,  # pool the pre-activation, then activate the maximum (equal for a monotone act)
    DEAD: tl.constexpr,  # relu / relu6: store the sentinel where the derivative at the maximum is 0
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,  # window and stride
    PH: tl.constexpr, PW: tl.constexpr,  # padding
    BLOCK: tl.constexpr,  # outputs per program
):
    # Reads each input element ~ceil(K/S)^2 times from cache (~N*C*H*W from memory), writes the pooled
    # output and one uint8 per pooled element; the full-size activation never reaches memory.
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
            # Round to the output dtype before comparing, so ties break as eager's pool over stored values.
            a = (y * scale + shift).to(OUT.dtype.element_ty).to(tl.float32)
            if not MONOTONE:
                a = _act_fwd(a, SLOPE, ACT).to(OUT.dtype.element_ty).to(tl.float32)
            a = tl.where(ok, a, float("-inf"))
            take = a > best  # strict: the first maximum wins, as in aten's max_pool2d
            best = tl.where(take, a, best)
            arg = tl.where(take, kh * KW + kw, arg)
    out = best
    if MONOTONE:
        out = _act_fwd(best, SLOPE, ACT)
    if DEAD:
        dead = out <= 0
        if ACT == 1:
            dead = dead | (out >= 6.0)
        arg = tl.where(dead, KH * KW, arg)
    tl.store(OUT + n * o_n + c * o_c + oh * o_h + ow * o_w, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(IDX + nc.to(tl.int64) * OH * OW + o, arg.to(tl.uint8), mask=mask)


def _bn_act_bwd_kernel(
    Y,  # pointer to the conv output (N, C, H, W); unread when NEED_Y is false
    G,  # pointer to the upstream gradient: (N, C, H, W), or (N, C, OH, OW) when POOL
    IDX,  # pointer to the uint8 within-window argmax (N, C, OH, OW) when POOL
    GY,  # pointer to the gradient written in PHASE 1, strides as Y's
    PG, PGX,  # pointers to fp32 [C, NUM_CHUNKS] partial sums of g and g * xhat (written in PHASE 0)
    PGS,  # PRELU: pointer to fp32 [C, NUM_CHUNKS] partial sums of the upstream gradient * z where z <= 0 (PHASE 0)
    WT, BS, MEAN, INVSTD,  # pointers to the [C] weight, bias (per HAS_W / HAS_B), fp32 mean and 1/std
    CA, CB, CD,  # pointers to fp32 [C] (COEF 0): PHASE 1 writes CA * g + CB * xhat + CD
    GB, GW,  # pointers to fp32 [C] bias and weight gradients, written by each channel's first program (COEF 1)
    SLOPE,  # leaky_relu negative slope
    SLOPES, PER_CHANNEL,  # PRELU: the fp32 slopes and whether one per channel
    H, W, OH, OW, M, NUM_CHUNKS,  # input plane, pooled plane, elements per channel, chunks per channel
    s_n, s_c, s_h, s_w,  # strides of Y and GY
    g_n, g_c, g_h, g_w,  # strides of G
    i_n, i_c, i_h, i_w,  # strides of IDX
    ACT: tl.constexpr, POOL: tl.constexpr, DEAD: tl.constexpr, NEED_Y: tl.constexpr, PHASE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, PRELU: tl.constexpr,
    COEF: tl.constexpr,  # PHASE 1's coefficients: 0 read CA/CB/CD; 1 from PG/PGX here; 2 invstd * w alone
    TRAINING: tl.constexpr,  # COEF 1: the batch statistics' terms CB and CD (else 0)
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,  # pool window, stride
    PH: tl.constexpr, PW: tl.constexpr,  # pool padding
    NH: tl.constexpr, NW: tl.constexpr,  # windows that can cover one element: ceil(KH / SH), ceil(KW / SW)
    BLOCK: tl.constexpr,  # elements of one channel per program
    BLOCK_P: tl.constexpr,  # partials summed per step (COEF 1)
):
    # g = dL/d(pre-activation) is recomputed in both phases instead of stored: with POOL it is gathered from
    # the <= ceil(K/S)^2 windows that can point at an element (a gather, so no atomics); then multiplied by
    # act'(bn(y)) unless the sentinel already encodes it (POOL and DEAD). PHASE 0 reads y + grad
    # (N*C*H*W*2 itemsize, pooled grad 1/S^2 of that) and writes 2 * C * NUM_CHUNKS fp32; PHASE 1 reads the
    # same and writes N*C*H*W itemsize.
    c = tl.program_id(0)
    j = tl.program_id(1)
    mean = tl.load(MEAN + c)
    invstd = tl.load(INVSTD + c)
    scale, shift = _affine_of(WT, BS, c, mean, invstd, HAS_W, HAS_B)  # the forward's, to the bit
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
    if PRELU:
        SLOPE = tl.load(SLOPES + c * PER_CHANNEL)
    up = g
    if not (POOL and DEAD):
        # The pre-activation as the forward stored it (rounded to y's dtype, then to the activation's), so the
        # derivative is eager's.
        z = (y * scale + shift).to(GY.dtype.element_ty).to(G.dtype.element_ty).to(tl.float32)
        g = tl.where(mask, _act_grad(g, z, SLOPE, ACT), 0.0)
    xhat = (y - mean) * invstd
    if PHASE == 0:
        tl.store(PG + c * NUM_CHUNKS + j, tl.sum(g, axis=0))
        tl.store(PGX + c * NUM_CHUNKS + j, tl.sum(tl.where(mask, g * xhat, 0.0), axis=0))
        if PRELU:
            tl.store(PGS + c * NUM_CHUNKS + j, tl.sum(tl.where(mask & (z <= 0), up * z, 0.0), axis=0))
    else:
        if COEF == 0:
            ca = tl.load(CA + c)
            cb = tl.load(CB + c)
            cd = tl.load(CD + c)
        else:  # _grad_coef_kernel's arithmetic, per program
            ca = invstd
            if HAS_W:
                ca = ca * tl.load(WT + c).to(tl.float32)
            cb = 0.0
            cd = 0.0
            if COEF == 1:
                gb, gw = _grad_sums(PG, PGX, c, NUM_CHUNKS, BLOCK_P)
                if j == 0:
                    tl.store(GB + c, gb)
                    tl.store(GW + c, gw)
                if TRAINING:
                    cb = -ca * gw / M
                    cd = -ca * gb / M
        gy = ca * g + cb * xhat + cd
        tl.store(GY + y_off, gy.to(GY.dtype.element_ty), mask=mask)


def _strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


def _pool_consts(pool: PoolSpec | None) -> dict:
    k, s, p = (pool.kernel, pool.stride, pool.padding) if pool else ((1, 1), (1, 1), (0, 0))
    return {"KH": k[0], "KW": k[1], "SH": s[0], "SW": s[1], "PH": p[0], "PW": p[1]}


def _stats_partials(k, y: torch.Tensor):
    """Stage 1 of the statistics, one launch: ``(partials fp32 [3, C, chunks], chunks)``."""
    n, c, h, w = y.shape
    m = n * h * w
    block, warps = calculate_settings(min(m, _CHUNK))
    chunks = cdiv(m, block)
    part = torch.empty(3, c, chunks, device=y.device, dtype=torch.float32)
    k["_stats_partial_kernel"][(c, chunks)](y, part[0], part[1], part[2], c, h, w, m, *_strides4(y), chunks,
                                           BLOCK=block, num_warps=warps)
    return part, chunks


def _finalize(k, part, chunks, m, eps, weight, bias, running_mean, running_var, momentum, stats):
    """Stage 2 as its own launch: the batch statistics into ``stats`` and the folded (scale, shift); updates the
    running statistics in place when given."""
    c = stats.shape[1]
    affine = torch.empty(2, c, device=stats.device, dtype=torch.float32)
    block_p, warps_p = calculate_settings(min(chunks, _CHUNK))
    k["_stats_finalize_kernel"][(c,)](
        part[0], part[1], part[2], stats[0], stats[1], _or(weight, stats), _or(bias, stats), affine[0], affine[1],
        _or(running_mean, stats), _or(running_var, stats), chunks, m, eps, momentum, 1 - momentum,
        HAS_W=weight is not None, HAS_B=bias is not None, RUNNING=running_mean is not None, BLOCK_P=block_p,
        num_warps=warps_p, **_EXACT)
    return affine[0], affine[1]


def _or(t, fallback):
    """A pointer argument for an optional tensor (the kernel reads it only when its flag says so)."""
    return fallback if t is None else t


def bn_act_forward_triton(y, weight, bias, running_mean, running_var, *, training, momentum, eps, act: Act = RELU,
                          pool: PoolSpec | None = None, slope=None):
    """Triton version of :func:`opsnn_lab.kernels.bn_act.bn_act_forward` (same shapes; stats fp32 [C]).

    y: (N, C, H, W) fp32/fp16/bf16, any strides; weight/bias/running stats: [C] or None. Training takes two
    launches where a channel has at most ``_INLINE_CHUNKS`` chunks (the normalize merges the statistics), three
    otherwise or with a pool; eval one.
    """
    k = _kernels(_interpreting())
    n, c, h, w = y.shape
    m = n * h * w
    mean = invstd = scale = shift = part = None
    chunks, final = 1, False
    if training:
        part, chunks = _stats_partials(k, y)
        stats = torch.empty(2, c, device=y.device, dtype=torch.float32)  # saved for backward: nothing more in it
        mean, invstd = stats[0], stats[1]
        final = pool is None and chunks <= _INLINE_CHUNKS
        if not final:
            scale, shift = _finalize(k, part, chunks, m, eps, weight, bias, running_mean, running_var, momentum,
                                     stats)
    else:
        mean = running_mean
        invstd = None if running_var is None else torch.rsqrt(running_var.float() + eps)
        scale, shift = scale_shift(c, weight, bias, mean, invstd, y.device)
    if pool is None:
        out = torch.empty_like(y, dtype=slope.dtype if slope is not None else y.dtype)
        block, warps = calculate_settings(min(m, _CHUNK))
        stand_in = out  # a pointer for each argument the kernel does not read
        p = part if final else (stand_in, stand_in, stand_in)
        slopes, per_channel = slope_args(slope, stand_in)
        k["_bn_act_fwd_kernel"][(c, cdiv(m, block))](
            y, out, _or(scale, stand_in), _or(shift, stand_in), p[0], p[1], p[2], _or(mean, stand_in),
            _or(invstd, stand_in), _or(weight, stand_in), _or(bias, stand_in), _or(running_mean, stand_in),
            _or(running_var, stand_in), act.negative_slope, slopes, per_channel, h, w, m, chunks, eps, momentum,
            1 - momentum, *_strides4(y), *_strides4(out), ACT=act.code, FINAL=final, HAS_W=weight is not None,
            HAS_B=bias is not None, RUNNING=running_mean is not None, PRELU=slope is not None, BLOCK=block,
            BLOCK_P=calculate_settings(min(chunks, _CHUNK))[0], num_warps=warps, **_EXACT)
        return out, mean, invstd, None
    oh, ow = pool.out_size(h, w)
    fmt = torch.channels_last if y.is_contiguous(memory_format=torch.channels_last) and c > 1 else None
    out = torch.empty(n, c, oh, ow, device=y.device, dtype=y.dtype, memory_format=fmt or torch.contiguous_format)
    idx = torch.empty(n, c, oh, ow, device=y.device, dtype=torch.uint8)
    block, warps = calculate_settings(min(oh * ow, _CHUNK))
    k["_bn_act_pool_fwd_kernel"][(n * c, cdiv(oh * ow, block))](
        y, out, idx, scale, shift, act.negative_slope, c, h, w, oh, ow, *_strides4(y), *_strides4(out),
        ACT=act.code, MONOTONE=act.monotone, DEAD=act.has_dead_zone, **_pool_consts(pool), BLOCK=block,
        num_warps=warps, **_EXACT)
    return out, mean, invstd, idx


def bn_act_backward_triton(grad_out, y, weight, bias, mean, invstd, idx, *, training, eps, act: Act = RELU,
                           pool: PoolSpec | None = None, in_shape=None, output_mask=(True, True, True), slope=None):
    """Triton version of :func:`opsnn_lab.kernels.bn_act.bn_act_backward`; BN weight/bias gradients by
    two-stage fixed-order sums. grad_out: output-shaped, y's dtype; idx: uint8 (N, C, OH, OW) with a pool.
    Two launches where the BN gradients are wanted and a channel has at most ``_INLINE_CHUNKS`` chunks (phase 1
    sums phase 0's partials itself), three beyond; one where they are not."""
    k = _kernels(_interpreting())
    n, c, h, w = tuple(y.shape) if y is not None else tuple(in_shape)
    m = n * h * w
    dev = grad_out.device
    # the kernel folds (scale, shift) from these as the forward did: no statistics is the identity
    mean32 = torch.zeros(c, device=dev, dtype=torch.float32) if mean is None else mean.float()
    inv32 = torch.ones(c, device=dev, dtype=torch.float32) if invstd is None else invstd.float()
    dead = pool is not None and act.has_dead_zone
    need_y = y is not None and (not dead or training or output_mask[1])
    if y is None and not dead:
        raise ValueError(f"y is needed to recompute the {act.name} derivative")
    like = y if y is not None else grad_out
    gy = torch.empty_like(y) if y is not None else torch.empty(n, c, h, w, device=dev, dtype=grad_out.dtype)
    block, warps = calculate_settings(min(m, _CHUNK))
    chunks = cdiv(m, block)
    prelu = slope is not None
    part = torch.empty(3 if prelu else 2, c, chunks, device=dev, dtype=torch.float32)
    slopes, per_channel = slope_args(slope, part)
    idx_t = idx if idx is not None else grad_out
    pc = _pool_consts(pool)
    cover = dict(NH=cdiv(pc["KH"], pc["SH"]), NW=cdiv(pc["KW"], pc["SW"]))
    block_p, warps_p = calculate_settings(min(chunks, _CHUNK))
    common = dict(ACT=act.code, POOL=pool is not None, DEAD=dead, NEED_Y=need_y, HAS_W=weight is not None,
                  HAS_B=bias is not None, PRELU=prelu, TRAINING=training, BLOCK=block, BLOCK_P=block_p, num_warps=warps, **pc,
                  **cover, **_EXACT)
    ph = pool.out_size(h, w) if pool else (h, w)
    coef = torch.empty(5, c, device=dev, dtype=torch.float32)  # gb, gw, then phase 1's CA, CB, CD

    def launch(phase, mode):
        k["_bn_act_bwd_kernel"][(c, chunks)](
            like, grad_out, idx_t, gy, part[0], part[1], part[-1], _or(weight, inv32), _or(bias, inv32), mean32,
            inv32, coef[2], coef[3], coef[4], coef[0], coef[1], act.negative_slope, slopes, per_channel, h, w, ph[0],
            ph[1], m, chunks,
            *_strides4(gy), *_strides4(grad_out), *_strides4(idx_t), PHASE=phase, COEF=mode, **common)

    gw = gb = None
    if training or prelu or (weight is not None and any(output_mask[1:])):
        launch(0, 0)  # phase 0 reads no coefficient
        gb, gw = coef[0], coef[1]
        if chunks <= _INLINE_CHUNKS:
            launch(1, 1)
        else:
            k["_grad_coef_kernel"][(c,)](part[0], part[1], _or(weight, inv32), inv32, *coef, chunks, m,
                                         HAS_W=weight is not None, TRAINING=training, BLOCK_P=block_p,
                                         num_warps=warps_p, **_EXACT)
            launch(1, 0)
    else:
        launch(1, 2)

    def cast(t, on):
        return None if t is None or not on or weight is None else t.to(weight.dtype)
    if not prelu:
        return gy, cast(gw, output_mask[1]), cast(gb, output_mask[2])
    gs = part[2].sum(1)  # fixed-order sums of the chunk partials, then over the channels for one slope
    gs = (gs if per_channel else gs.sum()).view(slope.shape).to(slope.dtype)
    return gy, cast(gw, output_mask[1]), cast(gb, output_mask[2]), gs
