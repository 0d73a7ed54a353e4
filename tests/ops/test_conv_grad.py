"""ops._conv_grad: a 1x1 conv's input gradient as one GEMM on CPU, against aten's ``convolution_backward`` for every
mask, dtype and odd shape; which convolutions keep aten's path; and the fused ops that take it against eager."""

import pytest
import torch
from torch import nn

from opsnn_lab.ops import FusedConvActDropoutConv, FusedConvBNAct, _conv_grad
from opsnn_lab.testing import assert_close_dtype, run_fwd_bwd, seeded

_ONE = ([1, 1], [0, 0], [1, 1])  # stride, padding, dilation of a pointwise conv


@pytest.fixture(autouse=True)
def _small_inputs_count(monkeypatch):
    """The tests' small inputs take the GEMM too (it starts at 64k elements, where it starts to pay)."""
    monkeypatch.setattr(_conv_grad, "_MIN_ELEMENTS", 0)


def _aten(grad, x, weight, bias_sizes, stride, padding, dilation, groups, mask):
    return torch.ops.aten.convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, False,
                                               [0, 0], groups, mask)


def _case(n, c_in, c_out, h, w, dtype, seed=0):
    x = seeded(n, c_in, h, w, seed=seed, dtype=dtype)
    weight = seeded(c_out, c_in, 1, 1, seed=seed + 1, dtype=dtype)
    grad = seeded(n, c_out, h, w, seed=seed + 2, dtype=dtype)
    return grad, x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 6, 5, 8, 8), (1, 3, 17, 9, 13), (3, 33, 7, 16, 5), (17, 4, 4, 8, 9)])
@pytest.mark.parametrize("mask", [[True, False, False], [True, True, False], [True, True, True], [True, False, True]])
def test_matches_atens_every_gradient(dtype, shape, mask):
    grad, x, weight = _case(*shape, dtype)
    assert _conv_grad.gemm_input_grad(x, weight, [1, 1], [0, 0], 1)
    bias_sizes = [weight.shape[0]] if mask[2] else [0]
    got = _conv_grad.convolution_backward(grad, x, weight, bias_sizes, *_ONE, 1, mask)
    want = _aten(grad, x, weight, bias_sizes, *_ONE, 1, mask)
    for i, (g, r) in enumerate(zip(got, want)):
        assert (g is None) == (r is None), i
        if g is not None:
            assert g.shape == r.shape and g.dtype == r.dtype and g.stride() == r.stride(), i
            assert_close_dtype(g, r, dtype, msg=f"gradient {i}")


def test_non_contiguous_gradient_and_input():
    grad, x, weight = _case(2, 5, 6, 9, 10, torch.float32)
    grad_t = grad.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    x_t = x[:, :, :, :].transpose(2, 3).contiguous().transpose(2, 3)
    got = _conv_grad.convolution_backward(grad_t, x_t, weight, [0], *_ONE, 1, [True, True, False])
    want = _aten(grad, x, weight, [0], *_ONE, 1, [True, True, False])
    assert got[0].is_contiguous()
    for g, r in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, r)


def test_a_broadcast_gradient():
    """``out.sum().backward()`` hands the backward a gradient with zero strides."""
    grad, x, weight = _case(2, 5, 6, 9, 10, torch.float32)
    flat = torch.ones(()).expand(grad.shape)
    got = _conv_grad.convolution_backward(flat, x, weight, [6], *_ONE, 1, [True, True, True])
    want = _aten(flat.contiguous(), x, weight, [6], *_ONE, 1, [True, True, True])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_empty_batch():
    grad, x, weight = _case(0, 3, 4, 8, 8, torch.float32)
    got = _conv_grad.convolution_backward(grad, x, weight, [4], *_ONE, 1, [True, True, True])
    assert got[0].shape == x.shape
    assert torch.equal(got[1], torch.zeros_like(weight)) and torch.equal(got[2], torch.zeros(4))


@pytest.mark.parametrize("change", ["stride", "padding", "groups", "kernel", "channels_last", "small_map",
                                    "few_elements", "deterministic"])
def test_other_convolutions_keep_atens_path(change, monkeypatch):
    grad, x, weight = _case(2, 4, 6, 8, 8, torch.float32)
    stride, padding, groups = [1, 1], [0, 0], 1
    if change == "stride":
        stride = [2, 2]
        grad = grad[:, :, ::2, ::2].contiguous()
    elif change == "padding":
        padding = [1, 1]
        grad = seeded(2, 6, 10, 10, seed=5)
    elif change == "groups":
        groups, weight = 2, weight[:, :2].contiguous()
    elif change == "kernel":
        weight, padding = seeded(6, 4, 3, 3, seed=3), [1, 1]
    elif change == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif change == "small_map":
        grad, x, weight = _case(2, 4, 6, 7, 9, torch.float32)  # 63 pixels
    elif change == "few_elements":
        monkeypatch.setattr(_conv_grad, "_MIN_ELEMENTS", x.numel() + 1)
    if change == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not _conv_grad.gemm_input_grad(x, weight, stride, padding, groups)
    calls = []
    monkeypatch.setattr(_conv_grad, "_input_grad_1x1", lambda *a: calls.append(a))
    got = _conv_grad.convolution_backward(grad, x, weight, [0], stride, padding, [1, 1], groups,
                                          [True, True, False])
    want = _aten(grad, x, weight, [0], stride, padding, [1, 1], groups, [True, True, False])
    assert not calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _counting(monkeypatch):
    calls = []
    real = _conv_grad._input_grad_1x1
    monkeypatch.setattr(_conv_grad, "_input_grad_1x1", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_channels_first_mlp_takes_it_and_matches_eager(dtype, monkeypatch):
    torch.manual_seed(0)
    conv1, conv2 = nn.Conv2d(5, 12, 1).to(dtype), nn.Conv2d(12, 5, 1).to(dtype)
    fused = FusedConvActDropoutConv.from_modules(conv1, nn.GELU(), None, conv2)
    eager = nn.Sequential(conv1, nn.GELU(), conv2)
    params = [conv1.weight, conv1.bias, conv2.weight, conv2.bias]
    x = seeded(3, 5, 9, 11, seed=1, dtype=dtype, requires_grad=True)
    calls = _counting(monkeypatch)
    out, grads = run_fwd_bwd(fused, [x], params)
    assert len(calls) == 2  # conv2's input gradient, then conv1's
    ref, ref_grads = run_fwd_bwd(eager, [x], params)
    assert_close_dtype(out, ref, dtype)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, dtype, msg=f"grad {i}")


@pytest.mark.parametrize("train", [True, False])
def test_a_pointwise_conv_bn_act_takes_it_and_matches_eager(train, monkeypatch):
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(6, 10, 1, bias=False), nn.BatchNorm2d(10)
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    eager = nn.Sequential(conv, bn, nn.ReLU6()).train(train)
    fused = FusedConvBNAct.from_modules(conv, bn, nn.ReLU6()).train(train)
    params = [conv.weight, bn.weight, bn.bias]
    x = seeded(4, 6, 8, 12, seed=2, requires_grad=True)
    calls = _counting(monkeypatch)
    out, grads = run_fwd_bwd(fused, [x], params)
    assert len(calls) == 1
    ref, ref_grads = run_fwd_bwd(eager, [x], params)
    assert_close_dtype(out, ref, torch.float32)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, torch.float32, msg=f"grad {i}")
