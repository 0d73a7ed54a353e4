"""Convolution forward and backward whose bits do not depend on the thread count, for ``strict()`` on CPU.

oneDNN splits the weight-gradient reduction of some convolutions (a 1x1 stride-2 one, for instance) and the
forward reduction of 1x1 ones over threads, so its bits follow ``torch.set_num_threads``. ``strict()`` turns
oneDNN off (aten's own kernels work sample by sample) and runs aten's convolution forward and backward on one
intra-op thread (the pool is restored after each): every thread count and batch size gets the bits one thread
gives, for any convolution (1-d to 3-d, grouped, transposed), within fp32 tolerance of oneDNN's. The forward
needs it too: aten's kernel runs one GEMM per sample, inside its batch loop's threads, except where the loop
runs inline (one thread, or a batch too small to split), and there MKL splits a deep reduction (a 7x7 or 5x5
kernel over 64 channels) over the threads it is given: on an AVX-512 Xeon the same sample came out with other
bits at 1 and 2 threads, and alone or in a batch of 8. The cost is those ops' parallelism while strict mode is
on and more than one thread is set.

It is registered at the autograd key with the dispatch key set, redispatching below autograd. A backward
that records its own graph (``create_graph=True``, for a double backward) needs the autograd kernel it
skips: a 1-d or 2-d, non-transposed float convolution then takes a differentiable composite with a fixed
order (the weight gradient from ``F.unfold`` columns through strict()'s fixed-order batched GEMM, the
input gradient as a transposed convolution, the bias gradient as strict()'s fixed-order sum, all through
autograd); other kinds raise.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from opsnn_lab.consistency import gemm_probe as gp

__all__ = ["convolution", "convolution_backward", "covers"]


def covers(x: torch.Tensor, transposed: bool) -> bool:
    """Whether the differentiable composite (double backward) computes this case."""
    return not transposed and x.dim() in (3, 4) and x.is_floating_point()


def _output_padding(size, out, stride, padding, dilation, kernel) -> list[int]:
    """The transposed convolution's output padding that gives back the input's ``size``."""
    return [s - ((o - 1) * st - 2 * p + d * (k - 1) + 1)
            for s, o, st, p, d, k in zip(size, out, stride, padding, dilation, kernel)]


def _weight_grad(grad, x, weight, stride, padding, dilation, groups):
    n, o = grad.shape[:2]
    cg, kh, kw = weight.shape[1:]
    cols = F.unfold(x, (kh, kw), dilation, padding, stride)  # (n, c * kh * kw, L)
    length = cols.shape[-1]
    a = grad.reshape(n, groups, o // groups, length).permute(1, 2, 0, 3).reshape(groups, o // groups, n * length)
    b = cols.reshape(n, groups, cg * kh * kw, length).permute(1, 0, 3, 2).reshape(groups, n * length, cg * kh * kw)
    with warnings.catch_warnings():
        # the probe's batch-size check concerns rows of activations; here the GEMM's batch is the groups and
        # its inner dimension the data batch, whose size a weight gradient depends on anyway
        warnings.filterwarnings("ignore", message=r"strict\(\): the reference GEMM path is not row-local")
        return torch.bmm(a, b).reshape(weight.shape)  # strict()'s fixed-order bmm, through autograd


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten::convolution`` (same schema) below autograd on CPU: what its own kernel runs
    (``aten::_convolution``, with the context's flags), on one intra-op thread."""
    flags = torch.backends.cudnn
    with gp.one_thread():
        return torch.ops.aten._convolution.default(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, flags.benchmark,
            flags.deterministic or torch.are_deterministic_algorithms_enabled(), flags.enabled,
            flags.allow_tf32)


def convolution_backward(keyset, grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                         groups, output_mask):
    """``aten::convolution_backward`` (same schema, after the dispatch key set), thread-count independent."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (grad, x, weight)):
        if not covers(x, transposed):
            raise NotImplementedError(
                "strict(): a double backward through a transposed or 3-d convolution is not supported (its "
                "fixed-order backward covers 1-d and 2-d convolutions); leave strict mode for it")
        return _composite(grad, x, weight, stride, padding, dilation, groups, output_mask)
    with gp.one_thread():
        return torch.ops.aten.convolution_backward.default.redispatch(
            keyset & torch._C._after_autograd_keyset, grad, x, weight, bias_sizes, stride, padding, dilation,
            transposed, output_padding, groups, output_mask)


def _composite(grad, x, weight, stride, padding, dilation, groups, output_mask):
    one_d = x.dim() == 3
    if one_d:  # as a 2-d convolution over a plane of height 1
        grad, x, weight = grad.unsqueeze(2), x.unsqueeze(2), weight.unsqueeze(2)
        stride, padding, dilation = [1, *stride], [0, *padding], [1, *dilation]
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        extra = _output_padding(x.shape[2:], grad.shape[2:], stride, padding, dilation, weight.shape[2:])
        grad_input = F.conv_transpose2d(grad, weight, None, stride, padding, extra, groups, dilation)
    if output_mask[1]:
        grad_weight = _weight_grad(grad, x, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad.sum([0, 2, 3])  # strict()'s fixed-order sum
    if one_d:
        grad_input = None if grad_input is None else grad_input.squeeze(2)
        grad_weight = None if grad_weight is None else grad_weight.squeeze(2)
    return grad_input, grad_weight, grad_bias
