"""Precision-aware optimizer update: unscale a low-precision grad, AdamW / SGD-momentum in fp32, write back.

Per element the fused AdamW step reads the grad (2 B in fp16/bf16), the fp32 master, exp_avg and
exp_avg_sq (12 B) and writes master, exp_avg, exp_avg_sq (12 B) and the low-precision param (2 B):
28 B. The unfused baseline (``GradScaler.unscale_`` + ``AdamW(foreach=True)`` on fp32 params) reads and
writes each fp32 tensor in ~10 separate passes (~100 B), so the fused step is memory-bound at ~1/3.

Three paths compute the same thing:
* ``*_reference``: ``torch._foreach_*`` ops, written like ``torch.optim``'s multi-tensor AdamW/SGD. The
  oracle of every test, and the fallback where the fused aten ops are missing.
* CPU fast path: ``torch._fused_adamw_`` / ``torch._fused_sgd_`` on the fp32 master (unscale folded in
  through ``grad_scale``), then one ``_foreach_copy_`` back into the low-precision params.
* Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``): one kernel per parameter that does it all in one
  pass; it reads the scale and the found-inf flag from device memory, so a skipped step costs no sync.

The caller (``MasterWeightOptimizer``) checks finiteness first: a step with a non-finite grad anywhere
must touch nothing, and only a check over all grads before any write can promise that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from opsnn_lab.kernels._dispatch import _interpreting, backend_for, calculate_settings, cdiv

__all__ = ["adamw_update_", "sgd_update_", "adamw_reference_", "sgd_reference_"]

tl = None  # triton.language, bound on first kernel build so importing this file never imports triton
_CHUNK_ELEMS = 1 << 23  # fp32 grads converted per fused call: bounds the transient copy to 32 MiB

Tensors = Sequence[torch.Tensor]


# ----------------------------------------------------------------------------------------------- torch path
def _unscaled_fp32(grads: Tensors, inv_scale: float) -> list[torch.Tensor]:
    out = [g.float() if g.dtype != torch.float32 else g.clone() for g in grads]
    if inv_scale != 1.0:
        torch._foreach_mul_(out, inv_scale)
    return out


def adamw_reference_(params: Tensors, grads: Tensors, masters: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, *,
                     step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                     inv_scale: float = 1.0) -> None:
    """AdamW (torch.optim semantics, decoupled decay) on fp32 ``masters``; ``params`` get the rounded result."""
    if not masters:
        return
    g = _unscaled_fp32(grads, inv_scale)
    if weight_decay:
        torch._foreach_mul_(masters, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1.0 - beta2)
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(masters, exp_avgs, denom, -lr / bc1)
    _write_back(params, masters)


def sgd_reference_(params: Tensors, grads: Tensors, masters: Tensors, momentum_bufs: Tensors, *, step: int,
                   lr: float, momentum: float, weight_decay: float, nesterov: bool = False,
                   inv_scale: float = 1.0) -> None:
    """SGD with momentum (torch.optim semantics, dampening 0; the buffer starts as the first grad)."""
    if not masters:
        return
    g = _unscaled_fp32(grads, inv_scale)
    if weight_decay:
        torch._foreach_add_(g, masters, alpha=weight_decay)
    if momentum:
        if step == 1:
            torch._foreach_copy_(momentum_bufs, g)
        else:
            torch._foreach_mul_(momentum_bufs, momentum)
            torch._foreach_add_(momentum_bufs, g)
        if nesterov:
            torch._foreach_add_(g, momentum_bufs, alpha=momentum)
        else:
            g = momentum_bufs
    torch._foreach_add_(masters, g, alpha=-lr)
    _write_back(params, masters)


def _write_back(params: Tensors, masters: Tensors) -> None:
    targets = [(p, m) for p, m in zip(params, masters) if p is not m]
    if targets:
        torch._foreach_copy_([p for p, _ in targets], [m for _, m in targets])


def _chunks(n_elems: Sequence[int]):
    start, acc = 0, 0
    for i, n in enumerate(n_elems):
        acc += n
        if acc >= _CHUNK_ELEMS:
            yield slice(start, i + 1)
            start, acc = i + 1, 0
    if start < len(n_elems):
        yield slice(start, len(n_elems))


def _adamw_fused_cpu(params, grads, masters, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay,
                     inv_scale):
    steps = torch.full((), float(step))
    grad_scale = None if inv_scale == 1.0 else torch.full((), 1.0 / inv_scale)
    for sl in _chunks([m.numel() for m in masters]):
        g = [x.float() if x.dtype != torch.float32 else x.clone() for x in grads[sl]]
        torch._fused_adamw_(list(masters[sl]), g, list(exp_avgs[sl]), list(exp_avg_sqs[sl]), [], [steps] * len(g),
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False, grad_scale=grad_scale)
    _write_back(params, masters)


def _sgd_fused_cpu(params, grads, masters, momentum_bufs, *, step, lr, momentum, weight_decay, nesterov, inv_scale):
    grad_scale = None if inv_scale == 1.0 else torch.full((), 1.0 / inv_scale)
    for sl in _chunks([m.numel() for m in masters]):
        g = [x.float() if x.dtype != torch.float32 else x.clone() for x in grads[sl]]
        bufs = list(momentum_bufs[sl]) if momentum else []
        torch._fused_sgd_(list(masters[sl]), g, bufs, weight_decay=weight_decay, momentum=momentum, lr=lr,
                          dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=step == 1,
                          grad_scale=grad_scale)
    _write_back(params, masters)


_HAS_FUSED = hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_sgd_")


# ---------------------------------------------------------------------------------------------- triton path
@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels; built per interpreter mode because triton picks the mode at decoration time."""
    global tl
    import triton
    import triton.language as language

    tl = language
    return {f.__name__: triton.jit(f) for f in (_adamw_kernel, _sgd_kernel)}


def _adamw_kernel(
    P,  # pointer to the model parameter (fp16/bf16/fp32), written with the rounded master
    G,  # pointer to the scaled gradient (fp16/bf16/fp32)
    MASTER, M, V,  # pointers to the fp32 master weight, exp_avg, exp_avg_sq
    SCALE_INV, FOUND_INF,  # pointers to one fp32 each: 1/loss-scale, and 1.0 if any grad of the step is non-finite
    N,  # elements
    lr, beta1, beta2, eps, weight_decay,  # fp32 hyper-parameters
    step_size, inv_sqrt_bc2,  # lr / (1 - beta1**t) and 1 / sqrt(1 - beta2**t)
    BLOCK: tl.constexpr,  # elements per program
):
    # Reads 2 + 12 B and writes 12 + 2 B per element (fp16 param and grad): one pass over memory.
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = tl.where(tl.load(FOUND_INF) == 0.0, N, 0)  # a skipped step masks every lane: nothing is written
    mask = offs < live
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(SCALE_INV)
    w = tl.load(MASTER + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    w = w * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    w = w - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(MASTER + offs, w, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    tl.store(P + offs, w.to(P.dtype.element_ty), mask=mask)


def _sgd_kernel(
    P,  # pointer to the model parameter (fp16/bf16/fp32)
    G,  # pointer to the scaled gradient
    MASTER, BUF,  # pointers to the fp32 master weight and momentum buffer
    SCALE_INV, FOUND_INF,  # pointers to one fp32 each (see _adamw_kernel)
    N,  # elements
    lr, momentum, weight_decay,  # fp32 hyper-parameters
    FIRST: tl.constexpr,  # first step: the buffer becomes the grad
    USE_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
    BLOCK: tl.constexpr,  # elements per program
):
    # Reads 2 + 8 B and writes 8 + 2 B per element (fp16 param and grad).
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = tl.where(tl.load(FOUND_INF) == 0.0, N, 0)  # a skipped step masks every lane: nothing is written
    mask = offs < live
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(SCALE_INV)
    w = tl.load(MASTER + offs, mask=mask, other=0.0)
    g = g + weight_decay * w
    if USE_MOMENTUM:
        if FIRST:
            b = g
        else:
            b = tl.load(BUF + offs, mask=mask, other=0.0) * momentum + g
        tl.store(BUF + offs, b, mask=mask)
        if NESTEROV:
            g = g + momentum * b
        else:
            g = b
    w = w - lr * g
    tl.store(MASTER + offs, w, mask=mask)
    tl.store(P + offs, w.to(P.dtype.element_ty), mask=mask)


def _flag_tensors(inv_scale, found_inf, device):
    scale_inv = inv_scale if isinstance(inv_scale, torch.Tensor) else torch.full((1,), float(inv_scale))
    flag = found_inf if found_inf is not None else torch.zeros(1)
    return scale_inv.float().reshape(1).to(device), flag.float().reshape(1).to(device)


def _launch(kernel, n: int, *args, **meta):
    block, warps = calculate_settings(min(n, 1024))
    grid = (cdiv(n, block),)
    kernel[grid](*args, BLOCK=block, num_warps=warps, **meta)


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous for the Triton update, got strides {t.stride()}")
    return t.view(-1)


def adamw_update_triton_(params, grads, masters, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                         weight_decay, inv_scale=1.0, found_inf=None) -> None:
    """Triton AdamW: per parameter ``p`` (N,) fp16/bf16/fp32, ``g`` (N,) any float, fp32 master/m/v (N,)."""
    if not masters:
        return
    k = _kernels(_interpreting())["_adamw_kernel"]
    scale_inv, flag = _flag_tensors(inv_scale, found_inf, masters[0].device)
    step_size, inv_sqrt_bc2 = lr / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step)
    for p, g, w, m, v in zip(params, grads, masters, exp_avgs, exp_avg_sqs):
        n = w.numel()
        if n:
            _launch(k, n, _flat(p, "param"), g.contiguous().view(-1), w.view(-1), m.view(-1), v.view(-1),
                    scale_inv, flag, n, lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2)


def sgd_update_triton_(params, grads, masters, momentum_bufs, *, step, lr, momentum, weight_decay,
                       nesterov=False, inv_scale=1.0, found_inf=None) -> None:
    """Triton SGD-momentum: per parameter ``p`` (N,) fp16/bf16/fp32, ``g`` (N,) any float, fp32 master/buf (N,)."""
    if not masters:
        return
    k = _kernels(_interpreting())["_sgd_kernel"]
    scale_inv, flag = _flag_tensors(inv_scale, found_inf, masters[0].device)
    bufs = momentum_bufs if momentum else masters
    for p, g, w, b in zip(params, grads, masters, bufs):
        n = w.numel()
        if n:
            _launch(k, n, _flat(p, "param"), g.contiguous().view(-1), w.view(-1), b.view(-1), scale_inv, flag, n,
                    lr, momentum, weight_decay, FIRST=step == 1, USE_MOMENTUM=bool(momentum), NESTEROV=nesterov)


# ------------------------------------------------------------------------------------------------- dispatch
def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def adamw_update_(params: Tensors, grads: Tensors, masters: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, *,
                  step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.0, inv_scale: float | torch.Tensor = 1.0,
                  found_inf: torch.Tensor | None = None) -> None:
    """Fused AdamW step in place: ``masters``/``exp_avgs``/``exp_avg_sqs`` fp32, ``params`` get the rounding.

    ``grads`` are the scaled low-precision grads; ``inv_scale`` is 1/loss-scale; ``step`` counts from 1.
    ``found_inf`` (a 1-element tensor) is honoured by the Triton path only: the others expect the caller
    to have skipped a non-finite step.
    """
    if backend_for(*masters[:1]) == "triton":
        return adamw_update_triton_(params, grads, masters, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                                    beta2=beta2, eps=eps, weight_decay=weight_decay, inv_scale=inv_scale,
                                    found_inf=found_inf)
    fn = _adamw_fused_cpu if _HAS_FUSED and not any(m.is_cuda for m in masters[:1]) else adamw_reference_
    fn(params, grads, masters, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, inv_scale=_scalar(inv_scale))


def sgd_update_(params: Tensors, grads: Tensors, masters: Tensors, momentum_bufs: Tensors, *, step: int, lr: float,
                momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                inv_scale: float | torch.Tensor = 1.0, found_inf: torch.Tensor | None = None) -> None:
    """Fused SGD(-momentum) step in place; arguments as in :func:`adamw_update_`."""
    if backend_for(*masters[:1]) == "triton":
        return sgd_update_triton_(params, grads, masters, momentum_bufs, step=step, lr=lr, momentum=momentum,
                                  weight_decay=weight_decay, nesterov=nesterov, inv_scale=inv_scale,
                                  found_inf=found_inf)
    fn = _sgd_fused_cpu if _HAS_FUSED and not any(m.is_cuda for m in masters[:1]) else sgd_reference_
    fn(params, grads, masters, momentum_bufs, step=step, lr=lr, momentum=momentum, weight_decay=weight_decay,
       nesterov=nesterov, inv_scale=_scalar(inv_scale))
