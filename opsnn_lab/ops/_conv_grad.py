"""A 2-d convolution's gradients for the fused ops' backward: aten's ``convolution_backward``, the call autograd
makes for an eager conv, except for one case on CPU.

The input gradient of a 1x1, stride-1, unpadded, ungrouped convolution is one GEMM, ``weight^T @ grad`` per
sample. On channels-first maps aten's CPU kernels reach it the long way: its own path (one thread, a batch under
16) computes the columns with that GEMM and then copies them into the gradient (col2im of a 1x1 kernel), oneDNN
reorders around its own. On an AVX-512 Xeon the GEMM alone took 0.1-0.9 of the call's time (fp32 and bf16, 1 and
2 threads, maps of 14x14 to 56x56), with the same bits in every case tried. The fused ops whose backward holds
such a conv's input gradient (a 1x1 Conv->BN->act, the convolutions of a channels-first MLP) take the GEMM; the
weight and bias gradients, channels-last maps (where oneDNN's kernel was as fast), maps under 8x8 and inputs under
64k elements (where a second call costs more than the copy) stay aten's, and so does everything under
deterministic algorithms (``strict()``), whose bits ``strict()`` pins.
"""

from __future__ import annotations

import torch

__all__ = ["convolution_backward", "gemm_input_grad"]

_CL = torch.channels_last
# Narrower maps make a thin GEMM per sample: at 7x7 over 960 channels aten's bf16 kernel was 1.4x faster
_MIN_PIXELS = 64
# Under this many input elements the second call (aten's, for the weight gradient) costs more than the copy the
# GEMM saves: fp32 4x16x8x8 1.42x aten's time, 4x16x16x16 1.22x, 8x32x16x16 0.88x (Xeon, one thread)
_MIN_ELEMENTS = 1 << 16


def gemm_input_grad(x: torch.Tensor, weight: torch.Tensor, stride, padding, groups: int) -> bool:
    """Whether the input gradient of ``conv2d(x, weight, stride=stride, padding=padding, groups=groups)`` is
    computed here as one GEMM per sample: CPU, a channels-first ``x`` of at least ``_MIN_PIXELS`` pixels a map and
    ``_MIN_ELEMENTS`` elements, a 1x1 kernel, stride 1, no padding, one group, deterministic algorithms off."""
    return (x.device.type == "cpu" and x.dim() == 4 and groups == 1 and tuple(weight.shape[-2:]) == (1, 1)
            and tuple(stride) == (1, 1) and tuple(padding) == (0, 0) and x.dtype == weight.dtype
            and x.shape[-1] * x.shape[-2] >= _MIN_PIXELS and x.numel() >= _MIN_ELEMENTS and _channels_first(x)
            and not torch.are_deterministic_algorithms_enabled())


def _channels_first(x: torch.Tensor) -> bool:
    return x.is_contiguous() or not x.is_contiguous(memory_format=_CL)


def _input_grad_1x1(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight^T @ grad`` per sample, contiguous as aten's is for a channels-first ``x``."""
    n, c_out, h, w = grad.shape
    w2 = weight.reshape(c_out, -1)
    # bmm over the weight broadcast (stride 0), not matmul: with a weight that requires grad, matmul folds the
    # batch into the rows through two full copies (its choice for autograd's sake, even under no_grad)
    return torch.bmm(w2.t().expand(n, -1, -1), grad.contiguous().view(n, c_out, h * w)).view(n, w2.shape[1], h, w)


def convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, groups, mask):
    """``aten.convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, False, [0, ...], groups,
    mask)``: ``(grad_x, grad_weight, grad_bias)``, each None where ``mask`` says so. ``x`` is read for its
    values only when the weight gradient is asked for."""
    args = (list(stride), list(padding), list(dilation), False, [0] * len(stride), groups)
    if not (mask[0] and gemm_input_grad(x, weight, stride, padding, groups)):
        return torch.ops.aten.convolution_backward(grad, x, weight, bias_sizes, *args, list(mask))
    grad_x = _input_grad_1x1(grad, x, weight)
    if not (mask[1] or mask[2]):
        return grad_x, None, None
    _, grad_w, grad_b = torch.ops.aten.convolution_backward(grad, x, weight, bias_sizes, *args,
                                                            [False, mask[1], mask[2]])
    return grad_x, grad_w, grad_b
