"""strict()'s convolution backward: at 2 threads the bits aten gives at one, every gradient, on strided, padded,
dilated, grouped, depthwise, 1-d, 3-d, transposed, channels-last and empty inputs; a double backward takes
the fixed-order composite, within tolerance of aten's, and refuses what that composite does not cover.
Depthwise convolutions take the per-tap path: the same bits at any thread count and, per sample, in any batch."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from opsnn_lab.consistency import fixed_conv
from opsnn_lab.consistency.strict import strict
from opsnn_lab.testing import seeded, threads

# (in, out, kernel, stride, padding, dilation, groups, bias, input shape after batch and channels)
CASES = {
    "1x1_s2": (16, 32, 1, 2, 0, 1, 1, False, (8, 9)),
    "3x3_p1": (8, 12, 3, 1, 1, 1, 1, True, (7, 6)),
    "depthwise_s2": (12, 12, 3, 2, 1, 1, 12, False, (9, 11)),
    "grouped_dilated": (8, 12, 3, 1, 2, 2, 2, True, (11, 10)),
    "5x5_s2_odd": (3, 5, 5, 2, 2, 1, 1, True, (13, 15)),
    "conv1d": (6, 8, 5, 2, 2, 1, 1, True, (13,)),
    "conv1d_grouped": (6, 9, 3, 1, 1, 1, 3, False, (10,)),
    # depthwise: strict()'s per-tap path (fixed_conv.depthwise)
    "depthwise_mult2_dilated": (6, 12, 3, 1, 2, 2, 6, True, (9, 8)),
    "depthwise_7x7": (8, 8, 7, 1, 3, 1, 8, True, (10, 9)),
    "depthwise_s2_5x3": (5, 5, (5, 3), 2, (2, 1), 1, 5, True, (12, 7)),
    "conv1d_depthwise_causal": (8, 8, 4, 1, 3, 1, 8, True, (11,)),
    "depthwise_same": (6, 6, 4, 1, "same", 2, 6, False, (8, 9)),
    "depthwise_valid_s2": (5, 5, 3, 2, "valid", 1, 5, True, (9, 8)),  # aten gets one padding value: [0]
}
DEPTHWISE = [c for c in CASES if "depthwise" in c]


def _conv(case):
    cin, cout, k, s, p, d, g, bias, plane = CASES[case]
    cls = nn.Conv1d if len(plane) == 1 else nn.Conv2d
    torch.manual_seed(0)
    return cls(cin, cout, k, s, p, d, g, bias=bias), (cin, *plane)


def _grads(conv, x, *, strict_on, n_threads=1):
    xi = x.clone().requires_grad_()
    conv.zero_grad(set_to_none=True)
    with threads(n_threads), (strict() if strict_on else nullcontext()):
        y = conv(xi)
        y.backward(seeded(*y.shape, seed=7))
    return [xi.grad] + [p.grad for p in conv.parameters()]


def _close(actual, expected):
    """fp32, reassociated sums: rtol 1e-5 and atol 1e-5 of the tensor's scale."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_keep_their_bits_at_any_thread_count_and_match_aten(case, layout):
    conv, shape = _conv(case)
    x = seeded(4, *shape, seed=3)
    if layout == "channels_last":
        if x.dim() != 4:
            pytest.skip("channels-last is a 4-d layout")
        x = x.contiguous(memory_format=torch.channels_last)
    one = _grads(conv, x, strict_on=True, n_threads=1)
    two = _grads(conv, x, strict_on=True, n_threads=2)
    ref = _grads(conv, x, strict_on=False, n_threads=1)  # oneDNN, the default mode
    for a, b, r in zip(one, two, ref):
        assert torch.equal(a, b)
        _close(a, r)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_other_dtypes_keep_their_bits_at_any_thread_count(dtype):
    conv, shape = _conv("3x3_p1")
    conv, x = conv.to(dtype), seeded(2, *shape, seed=3).to(dtype)
    one, two = (_grads(conv, x, strict_on=True, n_threads=n) for n in (1, 2))
    for a, b, r in zip(one, two, _grads(conv, x, strict_on=False, n_threads=1)):
        assert a.dtype == dtype and torch.equal(a, b)
        scale = r.abs().max().item()
        torch.testing.assert_close(a, r, rtol=1.6e-2, atol=(1e-2 if dtype == torch.bfloat16 else 1e-10) * scale)


def test_an_empty_batch_gives_zero_parameter_gradients():
    conv, shape = _conv("3x3_p1")
    x = seeded(0, *shape, seed=3)
    got, ref = _grads(conv, x, strict_on=True), _grads(conv, x, strict_on=False)
    for a, r in zip(got, ref):
        assert a.shape == r.shape and torch.equal(a, r)
    assert not got[1].any()


@pytest.mark.parametrize("kind", ["transposed", "conv3d"])
def test_transposed_and_3d_convolutions_too_but_not_their_double_backward(kind):
    torch.manual_seed(0)
    if kind == "transposed":
        conv, x = nn.ConvTranspose2d(4, 6, 3, 2, 1), seeded(2, 4, 5, 6, seed=1)
    else:
        conv, x = nn.Conv3d(3, 4, 3, 1, 1), seeded(2, 3, 4, 5, 6, seed=1)
    assert not fixed_conv.covers(x, transposed=kind == "transposed")
    one, two = (_grads(conv, x, strict_on=True, n_threads=n) for n in (1, 2))
    for a, b, r in zip(one, two, _grads(conv, x, strict_on=False, n_threads=1)):
        assert torch.equal(a, b)
        _close(a, r)
    xi = x.clone().requires_grad_()
    with strict(), pytest.raises(NotImplementedError, match="double backward through a transposed or 3-d"):
        (gx,) = torch.autograd.grad(conv(xi).square().sum(), xi, create_graph=True)


@pytest.mark.parametrize("case", ["1x1_s2", "depthwise_s2", "grouped_dilated", "conv1d_grouped",
                                  "depthwise_mult2_dilated", "conv1d_depthwise_causal"])
def test_double_backward_takes_the_fixed_order_composite(case):
    conv, shape = _conv(case)
    conv = conv.double()
    x = seeded(2, *shape, seed=1).double()
    results = []
    for on, n in ((True, 1), (True, 2), (False, 1)):
        xi = x.clone().requires_grad_()
        with threads(n), strict() if on else nullcontext():
            gx, gw = torch.autograd.grad(conv(xi).square().sum(), (xi, conv.weight), create_graph=True)
            ggx = torch.autograd.grad((gx.square().sum() + gw.square().sum()), xi)[0]
        results.append((gx.detach(), gw.detach(), ggx))
    for a, b, r in zip(*results):
        assert torch.equal(a, b)
        _close(a, r)


@pytest.mark.parametrize("dims, kernel, stride, groups", [(1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 2, 1), (2, 3, 1, 8),
                                                          (2, 7, 2, 1), (2, 5, 1, 1), (1, 9, 1, 1)])
def test_forward_keeps_its_bits_at_any_thread_count_and_batch_size(dims, kernel, stride, groups):
    """oneDNN's 1x1 convolution forward split its reduction over threads; under strict() oneDNN is off. aten's
    per-sample GEMM let MKL split a deep reduction (7x7 or 5x5 over 64 channels) over threads where its batch
    loop ran inline (one sample, or one thread): other bits at 1 and 2 threads on an AVX-512 Xeon."""
    conv = (nn.Conv1d if dims == 1 else nn.Conv2d)(64, 64, kernel, stride=stride, groups=groups)
    x = seeded(8, 64, *([96] if dims == 1 else [17, 17]), seed=3)
    outs = []
    for n in (1, 2):
        with strict(), threads(n):
            outs.append(conv(x))
            head, first = conv(x[:3]), conv(x[:1])
            with torch.inference_mode():
                inferred = conv(x[:1])
        assert torch.equal(head, outs[-1][:3])
        assert torch.equal(first, outs[-1][:1])
        assert torch.equal(inferred, outs[-1][:1])
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], conv(x), atol=1e-5, rtol=1e-5)
    assert torch.backends.mkldnn.enabled  # restored


@pytest.mark.parametrize("case", DEPTHWISE)
def test_a_depthwise_output_keeps_its_bits_per_sample_in_any_batch_and_thread_count(case):
    conv, shape = _conv(case)
    x = seeded(5, *shape, seed=4)
    assert fixed_conv.depthwise(x, conv.weight, False, conv.groups)
    with strict():
        outs = {}
        for n in (1, 2):
            with threads(n):
                outs[n] = (conv(x), conv(x[2:3]))
    assert torch.equal(outs[1][0], outs[2][0]) and torch.equal(outs[1][1], outs[2][1])
    assert torch.equal(outs[1][0][2:3], outs[1][1])  # sample 2 alone has the bits it has in the batch
    _close(outs[1][0], conv(x))
    assert outs[1][0].shape == conv(x).shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_precision_depthwise_convolution_keeps_aten_s_kernel(dtype):
    """Per-tap sums would round at each tap in a 16-bit type; aten's kernel accumulates in float32."""
    conv, shape = _conv("depthwise_7x7")
    conv, x = conv.to(dtype), seeded(2, *shape, seed=3).to(dtype)
    assert not fixed_conv.depthwise(x, conv.weight, False, conv.groups)
    one, two = (_grads(conv, x, strict_on=True, n_threads=n) for n in (1, 2))
    for a, b in zip(one, two):
        assert torch.equal(a, b)
