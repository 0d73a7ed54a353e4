"""Row formulas over ``fixed_sum`` for the ATen ops ``strict()`` replaces whose native kernels reduce through
per-thread buffers (measured as in :mod:`opsnn_lab.consistency.fixed_order`):

* ``_softmax_backward_data``: the native kernel changes bits with the thread count (rows of 33 or 37
  elements; rows of whole vectors do not); rewritten as ``y * (g - sum(g * y))`` over the fixed sum.
  The log_softmax backward stays native (thread- and batch-invariant, checked in the tests).
* ``native_layer_norm_backward``: the weight/bias gradients are reduced through per-thread buffers;
  all three gradients are rewritten as formulas over the fixed sum (the native kernel's ``out=``
  overload calls back into the functional one, so it cannot be reused from inside the override).
* ``_weight_norm_interface`` and its backward (``weight_norm`` on the last axis, Wav2Vec2's positional
  conv): the kernel for ``dim`` = the last axis sums the rows through one buffer per thread; rewritten as
  ATen's formulas over the fixed sum, in fp32 or wider. (``dim`` = 0 is row-local natively, and other
  ``dim`` s go through ``norm_except_dim``, i.e. ``linalg_vector_norm``, which is thread-invariant; so are
  ``var``/``std``, ``native_group_norm`` and its backward, and ``cumsum``: the tests check each.)

Each function calls only ops that strict mode does not override, or the fixed-order sum.
"""

from __future__ import annotations

import math

import torch

from opsnn_lab.consistency.fixed_order import fixed_sum

__all__ = ["softmax_backward", "layer_norm_backward", "weight_norm_interface", "weight_norm_interface_backward"]


# --------------------------------------------------------------------------- softmax / layer norm
def softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype) -> torch.Tensor:
    """d softmax: ``y * (g - sum(g * y, dim))`` with the fixed row sum."""
    gy = grad * output
    total = fixed_sum(gy, [dim], True)
    if gy.dtype == grad.dtype == output.dtype and gy.shape == grad.shape:
        # gy's buffer is reused: every fresh full-size temporary costs page faults, the same bits
        grad_in = torch.sub(grad, total, out=gy).mul_(output)
    else:
        grad_in = output * (grad - total)
    return grad_in.to(input_dtype)


def layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """All three gradients from row-local formulas over the fixed sum.

    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = grad_out * weight`` and the means
    over the normalised axes of each row; ``dweight``/``dbias`` sum over the rows.
    """
    want_dx, want_dw, want_db = output_mask
    n_norm = len(normalized_shape)
    rows = list(range(x.dim() - n_norm))
    cols = list(range(x.dim() - n_norm, x.dim()))
    count = math.prod(normalized_shape)
    # The same elementwise ops as the formulas above, in place or into one scratch buffer where the
    # dtypes allow it: each fresh full-size temporary costs page faults, and the bits are the same.
    xhat = (x - mean).mul_(rstd)
    same = xhat.dtype == grad_out.dtype and xhat.shape == grad_out.shape
    scratch = None
    dx = dw = db = None
    if want_dx:
        g = grad_out if weight is None else grad_out * weight
        mean_g = fixed_sum(g, cols, True).div_(count)
        if same and g.dtype == xhat.dtype:
            scratch = torch.mul(g, xhat, out=torch.empty_like(xhat))
            mean_gx = fixed_sum(scratch, cols, True).div_(count)
            torch.mul(xhat, mean_gx, out=scratch)
            dx = (g - mean_g if g is grad_out else g.sub_(mean_g)).sub_(scratch).mul_(rstd)
        else:
            mean_gx = fixed_sum(g * xhat, cols, True).div_(count)
            dx = (g - mean_g - xhat * mean_gx) * rstd
    if want_dw and weight is not None:
        prod = torch.mul(grad_out, xhat, out=scratch) if scratch is not None else grad_out * xhat
        dw = fixed_sum(prod, rows, False).to(weight.dtype)
    if want_db and bias is not None:
        db = fixed_sum(grad_out, rows, False).to(bias.dtype)
    return dx, dw, db


# --------------------------------------------------------------------------- weight norm
def _sum_except(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The fixed sum over every axis of ``x`` but ``dim``, kept as size-1 axes (a 1-d ``x``: itself)."""
    others = [d for d in range(x.dim()) if d != dim % x.dim()]
    return fixed_sum(x, others, True) if others else x.clone()


def weight_norm_interface(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, norm)`` with ``w = v * (g / norm)``, ``norm`` the 2-norm of ``v`` over every axis but ``dim``.

    Computed in fp32 or wider; ``norm`` comes back in ATen's dtype (fp32 for an fp16/bf16 ``g``, else ``g``'s), with
    ``g``'s shape, and ``w`` contiguous, as the native kernel gives them.
    """
    acc = torch.promote_types(v.dtype, torch.float32)
    va = v.to(acc)
    norm = _sum_except(va * va, dim).sqrt_()
    w = (va * (g.to(acc).reshape(norm.shape) / norm)).to(v.dtype).contiguous()  # any g with norm's numel
    return w, norm.to(acc if g.dtype in (torch.float16, torch.bfloat16) else g.dtype).reshape(g.shape)


def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim: int):
    """ATen's formulas: ``grad_g = sum(grad_w * v) / norm``, ``grad_v = a * grad_w - b * v`` with
    ``a = g / norm``, ``b = a * grad_g / norm``; the sum over every axis but ``dim``, fixed order."""
    acc = torch.promote_types(saved_v.dtype, torch.float32)
    v, gw = saved_v.to(acc), grad_w.to(acc)
    kept = [n if d == dim % v.dim() else 1 for d, n in enumerate(v.shape)]  # the shape _sum_except gives
    norm = saved_norms.to(acc).reshape(kept)
    grad_g = _sum_except(gw * v, dim).div_(norm)
    a = saved_g.to(acc).reshape(norm.shape) / norm
    b = a * grad_g / norm
    grad_v = (a * gw).sub_(b * v)
    return grad_v.to(saved_v.dtype), grad_g.to(saved_g.dtype).reshape(saved_g.shape)
