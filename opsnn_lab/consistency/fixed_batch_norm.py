"""Batch norm whose bits do not depend on the thread count, for ``strict()`` on CPU.

aten's CPU batch norm reduces the batch statistics (forward) and the weight/bias gradients (backward) through
per-thread partial sums wherever the channels are the innermost axis: 2-d ``(N, C)`` inputs
(``BatchNorm1d`` after a Linear, LeViT's attention projections), channels-last maps (what a depthwise convolution
may return: CvT's key/value projections). Their bits then follow ``torch.set_num_threads``; a contiguous
``(N, C, H, W)`` map is reduced per channel and is not affected. ``strict()`` runs aten's batch norm kernels on
one intra-op thread instead, for every layout (the pool is restored after each call): every thread count gets
the bits one thread gives. Registered at the CPU key, below autograd, so the autograd graph (double backward
included) is aten's own; each override calls the twin ATen op that shares the kernel (the overridden one would
call itself): ``native_batch_norm`` -> ``_native_batch_norm_legit``, ``native_batch_norm_backward`` ->
``batch_norm_backward``.
"""

from __future__ import annotations

import torch

from opsnn_lab.consistency import gemm_probe as gp

__all__ = ["native_batch_norm", "native_batch_norm_backward"]


def native_batch_norm(x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float):
    """``aten::native_batch_norm`` (same schema), on one intra-op thread."""
    with gp.one_thread():
        if running_mean is None or running_var is None:
            return torch.ops.aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)
        return torch.ops.aten._native_batch_norm_legit.default(x, weight, bias, running_mean, running_var, training,
                                                              momentum, eps)


def native_batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train: bool,
                               eps: float, output_mask):
    """``aten::native_batch_norm_backward`` (same schema), on one intra-op thread."""
    if weight is None:  # the twin op takes a weight; 1 is what no weight means (its gradient is not asked for)
        weight = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    reserve = torch.empty(0, dtype=torch.uint8, device=x.device)
    with gp.one_thread():
        return torch.ops.aten.batch_norm_backward.default(grad_out, x, weight, running_mean, running_var, save_mean,
                                                          save_invstd, train, eps, list(output_mask), reserve)
