"""Gated activation ``dropout(act(gate) * up)`` over the packed ``[gate | up]`` GEMM output: Triton kernels and torch reference.

The gated MLP (SwiGLU, GeGLU) computes ``gu = x @ [W_gate | W_up].T`` as one GEMM, so ``gu`` is (M, 2I) with
the gate pre-activation in columns ``[0, I)`` and the up projection in ``[I, 2I)``. The forward writes
``out = dropout(act(g) * u)`` (M, I) and keeps nothing else; the backward reads ``gu`` again, writes the
packed gradient ``[dg | du]`` (M, 2I) that the one backward GEMM consumes, and on request the recomputed
``out`` that the down projection's weight gradient needs. Activations and their derivatives are the ones
of ``gelu_dropout`` (``ACTS``). Element ``(i, j)`` of the (M, I) product uses dropout counter
``offset + i * I + j`` (see ``rng``); ``p = 0`` skips the mask.

``gated_product_fwd`` / ``gated_product_bwd`` run the same kernels on two separate tensors ``gate`` and ``up``
(no dropout): the product of a gated MLP whose projections are not plain Linears (low-rank adapters, quantised
layers), where nothing but ``act(gate) * up`` can be fused.
"""

from __future__ import annotations

import torch

from opsnn_lab._checks import check_choice, check_range, check_tensor, check_type
from opsnn_lab.kernels._dispatch import backend_for, calculate_settings
from opsnn_lab.kernels.gelu_dropout import ACTS, act_backward, act_forward
from opsnn_lab.kernels.rng import dropout_mask, keep_threshold, seed_keys

try:
    import triton
    import triton.language as tl

    from opsnn_lab.kernels.gelu_dropout import act_value_and_grad
    from opsnn_lab.kernels.rng import dropout_keep
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["gated_act_fwd", "gated_act_bwd", "gated_act_fwd_reference", "gated_act_bwd_reference",
           "gated_product_fwd", "gated_product_bwd", "gated_product_fwd_reference", "gated_product_bwd_reference"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_TILE_N = 1024  # product columns per program (the row is tiled so I is unbounded)
_ROWS = 8  # rows per program


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _halves(gu, gate_first=True):
    """``(gate, up)`` views of the packed ``gu``: ``[gate | up]``, or ``[up | gate]`` (diffusers' GEGLU)."""
    first, second = gu.chunk(2, 1)  # one call for both views (slicing takes two, ~1.5x the time)
    return (first, second) if gate_first else (second, first)


def _keep(p, seed, offset, shape, like):
    return dropout_mask(seed, offset, shape, p, like.device, dtype=like.dtype) if p > 0 else None


# --------------------------------------------------------------------------- torch reference
def gated_product_fwd_reference(gate, up, act):
    """Torch path: ``act(gate) * up`` in gate's dtype (fp16/bf16: computed in fp32, rounded once)."""
    low = gate.dtype in (torch.float16, torch.bfloat16)
    a = act_forward(gate.float() if low else gate, act)
    return a.mul_(up).to(gate.dtype)


def gated_product_bwd_reference(grad_out, gate, up, act):
    """Torch path: ``(d gate, d up)`` of ``act(gate) * up``, the activation recomputed from ``gate``."""
    low = gate.dtype in (torch.float16, torch.bfloat16)
    g, u, d = (gate.float(), up.float(), grad_out.float()) if low else (gate, up, grad_out)
    a = act_forward(g, act)
    return act_backward(d * u, g, act).to(gate.dtype), a.mul_(d).to(gate.dtype)


def gated_act_fwd_reference(gu, act, p=0.0, seed=0, offset=0, gate_first=True):
    """Torch path: ``dropout(act(gate) * up)`` (M, I) from the packed (M, 2I) ``gu``."""
    out = gated_product_fwd_reference(*_halves(gu, gate_first), act)
    keep = _keep(p, seed, offset, out.shape, out)
    return out if keep is None else out.mul_(keep).mul_(_scale(p))


def gated_act_bwd_reference(grad_out, gu, act, p=0.0, seed=0, offset=0, want_out=False, gate_first=True):
    """Torch path: ``(grad_gu, out | None)``: packed ``[d gate | d up]`` (M, 2I), in ``gu``'s order, and the
    recomputed output."""
    g, u = _halves(gu, gate_first)
    keep = _keep(p, seed, offset, grad_out.shape, grad_out)
    if keep is not None:
        grad_out = grad_out * keep * _scale(p)
    low = gu.dtype in (torch.float16, torch.bfloat16)
    if low:
        g, u, grad_out = g.float(), u.float(), grad_out.float()
    a = act_forward(g, act)
    grad_gu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
    dg, du = _halves(grad_gu, gate_first)
    dg.copy_(act_backward(grad_out * u, g, act))
    torch.mul(grad_out, a, out=du)  # straight into the packed half: one pass fewer
    out = None
    if want_out:
        out = a.mul_(u).to(gu.dtype)
        if keep is not None:
            out.mul_(keep).mul_(_scale(p))
    return grad_gu, out


# --------------------------------------------------------------------------- Triton kernels
if triton is not None:

    @triton.jit
    def _gated_act_fwd_kernel(
        G,  # pointer to the (M, N) gate pre-activations (row stride SG; the packed [gate | up]: its first half)
        U,  # pointer to the (M, N) up projection (row stride SU; packed: the second half)
        OUT,  # pointer to the (M, N) contiguous output, dropout(act(gate) * up)
        SG,  # row stride of G (2N when packed)
        SU,  # row stride of U
        M,  # rows
        N,  # product columns
        OFFSET,  # dropout counter of element (0, 0)
        S1,  # seed word 1 (rng.seed_keys)
        S2,  # seed word 2
        THRESHOLD,  # keep iff u16 >= THRESHOLD (rng.keep_threshold)
        SCALE,  # 1 / (1 - p)
        ACT: tl.constexpr,  # activation, index into ACTS
        DROPOUT: tl.constexpr,  # p > 0
        ROWS: tl.constexpr,  # rows per program
        BLOCK_N: tl.constexpr,  # product columns per program
    ):
        # Bytes per product element: read gate and up (2s), write out (s): 3s, s = dtype size.
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        for r in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + r
            m = cmask & (cols * 0 + row < M)  # block-shaped: a scalar row mask is not a valid load mask
            g = tl.load(G + row * SG + cols, mask=m, other=0.0).to(tl.float32)
            u = tl.load(U + row * SU + cols, mask=m, other=0.0).to(tl.float32)
            a, _ = act_value_and_grad(g, ACT)
            y = a * u
            if DROPOUT:
                keep = dropout_keep(OFFSET + row * N + cols, S1, S2, THRESHOLD)
                y = tl.where(keep, y * SCALE, 0.0)
            tl.store(OUT + row * N + cols, y.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _gated_act_bwd_kernel(
        GRAD,  # pointer to the (M, N) contiguous upstream gradient of the output
        G,  # pointer to the saved (M, N) gate pre-activations, row stride SG
        U,  # pointer to the saved (M, N) up projection, row stride SU
        DG,  # pointer to the (M, N) gradient of gate (output), row stride SD (packed: [d gate | d up], 2N)
        DU,  # pointer to the (M, N) gradient of up (output), row stride SD
        OUT,  # pointer to the (M, N) contiguous recomputed forward output (unused unless WANT_OUT)
        SG,  # row stride of G
        SU,  # row stride of U
        SD,  # row stride of DG and DU
        M,  # rows
        N,  # product columns
        OFFSET,  # dropout counter of element (0, 0)
        S1,  # seed word 1
        S2,  # seed word 2
        THRESHOLD,  # keep iff u16 >= THRESHOLD
        SCALE,  # 1 / (1 - p)
        ACT: tl.constexpr,  # activation, index into ACTS
        DROPOUT: tl.constexpr,  # p > 0
        WANT_OUT: tl.constexpr,  # also write the recomputed forward output
        ROWS: tl.constexpr,  # rows per program
        BLOCK_N: tl.constexpr,  # product columns per program
    ):
        # Bytes per product element: read grad, gate, up (3s), write d gate, d up (2s), out (s) if WANT_OUT: 5s-6s.
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        for r in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + r
            m = cmask & (cols * 0 + row < M)  # block-shaped: a scalar row mask is not a valid load mask
            g = tl.load(G + row * SG + cols, mask=m, other=0.0).to(tl.float32)
            u = tl.load(U + row * SU + cols, mask=m, other=0.0).to(tl.float32)
            d = tl.load(GRAD + row * N + cols, mask=m, other=0.0).to(tl.float32)
            a, da = act_value_and_grad(g, ACT)
            if DROPOUT:
                keep = dropout_keep(OFFSET + row * N + cols, S1, S2, THRESHOLD)
                d = tl.where(keep, d * SCALE, 0.0)
            tl.store(DG + row * SD + cols, (d * u * da).to(DG.dtype.element_ty), mask=m)
            tl.store(DU + row * SD + cols, (d * a).to(DU.dtype.element_ty), mask=m)
            if WANT_OUT:
                y = a * u
                if DROPOUT:
                    y = tl.where(keep, y * SCALE, 0.0)
                tl.store(OUT + row * N + cols, y.to(OUT.dtype.element_ty), mask=m)


def _launch(m, i):
    block_n, warps = calculate_settings(min(i, _TILE_N))
    return (triton.cdiv(m, _ROWS), triton.cdiv(i, block_n)), block_n, warps


def _rng_args(p, seed, offset):
    s1, s2 = seed_keys(seed) if p > 0 else (0, 0)
    return offset, s1, s2, keep_threshold(p), _scale(p)


def _fwd(g, u, out, act, p=0.0, seed=0, offset=0):
    """Launch the forward kernel on (M, N) ``g`` and ``u`` of unit column stride (rows as their views stride them)."""
    if out.numel():
        grid, block_n, warps = _launch(*g.shape)
        _gated_act_fwd_kernel[grid](g, u, out, g.stride(0), u.stride(0), *g.shape, *_rng_args(p, seed, offset),
                                    ACT=ACTS.index(act), DROPOUT=p > 0, ROWS=_ROWS, BLOCK_N=block_n, num_warps=warps)
    return out


def _bwd(grad, g, u, dg, du, out, act, p=0.0, seed=0, offset=0):
    """Launch the backward kernel: contiguous (M, N) ``grad`` (and ``out`` when not None), ``dg`` / ``du`` of one
    row stride (the halves of one packed buffer, or two tensors)."""
    if grad.numel():
        grid, block_n, warps = _launch(*g.shape)
        _gated_act_bwd_kernel[grid](grad, g, u, dg, du, grad if out is None else out, g.stride(0), u.stride(0),
                                    dg.stride(0), *g.shape, *_rng_args(p, seed, offset), ACT=ACTS.index(act),
                                    DROPOUT=p > 0, WANT_OUT=out is not None, ROWS=_ROWS, BLOCK_N=block_n,
                                    num_warps=warps)


def _check(gu, act, p, gate_first=True):
    check_type("gate_first", gate_first, bool)
    check_tensor("gu", gu, dtypes=_FLOATS, dim=2)
    if gu.shape[1] % 2:
        raise ValueError(f"gu must have an even number of columns ([gate | up]), got shape {tuple(gu.shape)}")
    check_choice("act", act, ACTS)
    check_range("p", p, 0.0, 1.0)


def gated_act_fwd(gu, act, p=0.0, seed=0, offset=0, gate_first=True):
    """``dropout(act(gate) * up)``.

    gu: (M, 2I) float tensor, the packed [gate | up] GEMM output (made contiguous); ``gate_first=False``: packed
    [up | gate]. Returns (M, I) in gu's dtype. ``act`` in ``ACTS``; ``p`` in [0, 1] with ``seed``/``offset``
    picking the mask.
    """
    _check(gu, act, p, gate_first)
    gu = gu.contiguous()
    if backend_for(gu) != "triton":
        return gated_act_fwd_reference(gu, act, p, seed, offset, gate_first)
    out = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype, device=gu.device)
    return _fwd(*_halves(gu, gate_first), out, act, p, seed, offset)


def gated_act_bwd(grad_out, gu, act, p=0.0, seed=0, offset=0, want_out=False, gate_first=True):
    """Gradient of ``gated_act_fwd`` w.r.t. the packed ``gu``, regenerating the mask.

    grad_out: (M, I), gu: (M, 2I), one float dtype. Returns ``(grad_gu, out)``: grad_gu (M, 2I) packed as ``gu``
    (``[d gate | d up]``, or ``[d up | d gate]`` with ``gate_first=False``); ``out`` (M, I), the recomputed
    forward output, when ``want_out`` (else None).
    """
    _check(gu, act, p, gate_first)
    check_tensor("grad_out", grad_out, dtypes=(gu.dtype,), dim=2, device=gu.device)
    if grad_out.shape != (gu.shape[0], gu.shape[1] // 2):
        raise ValueError(f"grad_out must have shape {(gu.shape[0], gu.shape[1] // 2)}, got {tuple(grad_out.shape)}")
    if backend_for(gu) != "triton":
        return gated_act_bwd_reference(grad_out, gu, act, p, seed, offset, want_out, gate_first)
    gu, grad_out = gu.contiguous(), grad_out.contiguous()
    grad_gu = torch.empty_like(gu)
    out = torch.empty_like(grad_out) if want_out else None
    _bwd(grad_out, *_halves(gu, gate_first), *_halves(grad_gu, gate_first), out, act, p, seed, offset)
    return grad_gu, out


# --------------------------------------------------------------------------- the product of two tensors
# ``act(gate) * up`` where gate and up are two tensors of one shape, however they were computed (projections that
# are not one Linear: low-rank adapters, quantised layers, experts). The kernels above read them through their row
# strides; a tensor whose rows are not evenly strided is copied for the call.
def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (M, N) rows of its last dim, unit column stride: a view where one exists, else a copy."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _check_pair(gate, up, act):
    check_tensor("gate", gate, dtypes=_FLOATS)
    check_tensor("up", up, dtypes=(gate.dtype,), device=gate.device)
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)} (the product does not broadcast), "
                         f"got {tuple(up.shape)}")
    check_choice("act", act, ACTS)


def gated_product_fwd(gate, up, act):
    """``act(gate) * up`` for two float tensors of one shape, dtype and device. Returns a new tensor of that shape
    (contiguous from the kernel; the torch path keeps eager's memory format). ``act`` in ``ACTS``."""
    _check_pair(gate, up, act)
    if backend_for(gate) != "triton":
        return gated_product_fwd_reference(gate, up, act)
    g, u = _rows(gate), _rows(up)
    return _fwd(g, u, torch.empty(g.shape, dtype=gate.dtype, device=gate.device), act).view(gate.shape)


def gated_product_bwd(grad_out, gate, up, act):
    """Gradient of ``gated_product_fwd``: ``(d gate, d up)``, each of gate's shape and dtype, recomputing
    ``act(gate)`` from the saved ``gate`` (nothing but gate and up is read)."""
    _check_pair(gate, up, act)
    check_tensor("grad_out", grad_out, dtypes=(gate.dtype,), device=gate.device)
    if grad_out.shape != gate.shape:
        raise ValueError(f"grad_out must have gate's shape {tuple(gate.shape)}, got {tuple(grad_out.shape)}")
    if backend_for(gate) != "triton":
        return gated_product_bwd_reference(grad_out, gate, up, act)
    g, u, d = _rows(gate), _rows(up), grad_out.reshape(-1, gate.shape[-1] if gate.dim() else 1).contiguous()
    dg, du = (torch.empty(g.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
    _bwd(d, g, u, dg, du, None, act)
    return dg.view(gate.shape), du.view(gate.shape)
