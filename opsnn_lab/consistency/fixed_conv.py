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

A depthwise convolution (each group one input channel: MobileNet's, EfficientNet's, ConvNeXt's 7x7, Mamba's causal
1-d) is the one kind aten's own kernel runs badly: a GEMM per group and sample (MobileNetV2 11.5x slower a training
step under strict() than out of it). It takes a per-tap path instead, float32 and float64, 1-d and 2-d: the output
sums the k*k shifted input views times their weight in a fixed order, the input gradient adds the gradient times
each weight into the shifted views of a zero tensor, the weight and bias gradients are strict()'s fixed-order sums
of those products; elementwise products and sums, so the bits are the same at any thread count and each sample's
output the same in any batch. A backward recording its own graph runs the same ops through autograd.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from opsnn_lab.consistency import gemm_probe as gp

__all__ = ["convolution", "convolution_backward", "covers", "depthwise"]


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


def depthwise(x: torch.Tensor, weight: torch.Tensor, transposed: bool, groups: int) -> bool:
    """Whether the per-tap path computes this convolution: 1-d or 2-d, not transposed, float32 or float64, each
    group one input channel (any channel multiplier)."""
    return (not transposed and x.dim() in (3, 4) and x.dtype in (torch.float32, torch.float64) and groups > 1
            and x.shape[1] == groups and weight.shape[1] == 1 and weight.dtype == x.dtype)


def _sizes(x, *sizes) -> list[list[int]]:
    """Each of ``sizes`` (stride, padding, dilation) with one value per spatial dim of ``x`` (aten takes one value
    for all of them too: ``padding="same"`` resolved to a symmetric padding)."""
    dims = x.dim() - 2
    return [list(v) * dims if len(v) == 1 else list(v) for v in sizes]


def _planar(x, weight, stride, padding, dilation):
    """A 1-d convolution as a 2-d one over a plane of height 1; the 2-d sizes as lists."""
    stride, padding, dilation = _sizes(x, stride, padding, dilation)
    if x.dim() == 3:
        return x.unsqueeze(2), weight.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation]
    return x, weight, stride, padding, dilation


def _out_size(size, kernel, stride, padding, dilation) -> list[int]:
    return [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(size, kernel, stride, padding, dilation)]


def _taps(plane, weight, stride, dilation, out):
    """``(view of plane, weight column)`` for each tap in row-major order: the strided view of the padded (and
    per-multiplier repeated) input the tap multiplies, and its weight as ``(1, O, 1, 1)``."""
    kh, kw = weight.shape[2:]
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dilation[0], i * dilation[0] + stride[0] * (out[0] - 1) + 1, stride[0])
            cols = slice(j * dilation[1], j * dilation[1] + stride[1] * (out[1] - 1) + 1, stride[1])
            yield plane[:, :, rows, cols], weight[:, :, i, j].reshape(1, -1, 1, 1)


def _layout(x: torch.Tensor):
    last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if last else torch.contiguous_format


def _padded(x2, w2, padding) -> torch.Tensor:
    """The zero-padded input the taps read, each input channel repeated for its output channels (a channel
    multiplier: output channel o reads input channel o // m)."""
    plane = F.pad(x2, (padding[1], padding[1], padding[0], padding[0]))
    mult = w2.shape[0] // x2.shape[1]
    return plane.repeat_interleave(mult, dim=1) if mult > 1 else plane


def _depthwise_forward(x, weight, bias, stride, padding, dilation):
    x2, w2, stride, padding, dilation = _planar(x, weight, stride, padding, dilation)
    out = _out_size(x2.shape[2:], w2.shape[2:], stride, padding, dilation)
    y = None
    for view, w in _taps(_padded(x2, w2, padding), w2, stride, dilation, out):
        product = view * w  # a product, then a sum: no fused multiply-add, whose bits differ from them
        y = product if y is None else y.add_(product)
    if bias is not None:
        y = y.add_(bias.reshape(1, -1, 1, 1))
    y = y.contiguous(memory_format=_layout(x))
    return y.squeeze(2) if x.dim() == 3 else y


def _depthwise_backward(grad, x, weight, stride, padding, dilation, output_mask):
    x2, w2, stride, padding, dilation = _planar(x, weight, stride, padding, dilation)
    g2 = grad.unsqueeze(2) if x.dim() == 3 else grad
    out, (n, c, h, w), mult = g2.shape[2:], x2.shape, w2.shape[0] // x2.shape[1]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        plane = g2.new_zeros(n, w2.shape[0], h + 2 * padding[0], w + 2 * padding[1])
        for view, wt in _taps(plane, w2, stride, dilation, out):
            view.add_(g2 * wt)
        plane = plane[:, :, padding[0]:padding[0] + h, padding[1]:padding[1] + w]
        if mult > 1:  # the multiplier's output channels, in order, into their input channel
            planes = plane.reshape(n, c, mult, h, w)
            plane = planes[:, :, 0]
            for k in range(1, mult):
                plane = plane + planes[:, :, k]
        grad_input = plane.contiguous(memory_format=_layout(x))
        grad_input = grad_input.squeeze(2) if x.dim() == 3 else grad_input
    if output_mask[1]:
        taps = _taps(_padded(x2, w2, padding), w2, stride, dilation, out)
        sums = [(g2 * view).sum([0, 2, 3]) for view, _ in taps]  # strict()'s fixed-order sum, tap by tap
        grad_weight = torch.stack(sums, 1).reshape(weight.shape)
    if output_mask[2]:
        grad_bias = g2.sum([0, 2, 3])
    return grad_input, grad_weight, grad_bias


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten::convolution`` (same schema) below autograd on CPU: a depthwise one by taps (``depthwise``), the
    others by what aten's own kernel runs (``aten::_convolution``, with the context's flags) on one intra-op
    thread."""
    if depthwise(x, weight, transposed, groups) and min(_out_size(
            x.shape[2:], weight.shape[2:], *_sizes(x, stride, padding, dilation))) > 0:
        return _depthwise_forward(x, weight, bias, stride, padding, dilation)
    flags = torch.backends.cudnn
    with gp.one_thread():
        return torch.ops.aten._convolution.default(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, flags.benchmark,
            flags.deterministic or torch.are_deterministic_algorithms_enabled(), flags.enabled,
            flags.allow_tf32)


def convolution_backward(keyset, grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                         groups, output_mask):
    """``aten::convolution_backward`` (same schema, after the dispatch key set), thread-count independent."""
    if depthwise(x, weight, transposed, groups):
        return _depthwise_backward(grad, x, weight, stride, padding, dilation, output_mask)
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
