"""FusedConvBNAct with a PReLU (UVDoc's, face-recognition nets' Conv -> BN -> PReLU): training and eval against eager
with every gradient (the PReLU's weight's included) for 1-d, 2-d and 3-d chains and one slope or one per channel;
bf16 / fp16 within twice eager's error; CPU autocast as eager; the bn_act Triton kernels with a slope under the
interpreter against the torch path; what it saves; empty batches; the reasons."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opsnn_lab.kernels import bn_act as K
from opsnn_lab.kernels import bn_act_triton as T
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.ops import FusedConvBNAct
from opsnn_lab.testing import (
    assert_close_dtype,
    assert_within_eager_error,
    run_fwd_bwd,
    seeded,
    triton_interpreter_ready,
)

CHAINS = {1: (nn.Conv1d, nn.BatchNorm1d, (2, 3, 11)), 2: (nn.Conv2d, nn.BatchNorm2d, (2, 3, 7, 9)),
          3: (nn.Conv3d, nn.BatchNorm3d, (2, 3, 4, 5, 5))}


def _chain(dim, slopes, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    conv_cls, bn_cls, shape = CHAINS[dim]
    eager = nn.Sequential(conv_cls(3, 6, 3, padding=1), bn_cls(6), nn.PReLU(slopes)).to(dtype)
    with torch.no_grad():
        eager[1].weight.normal_(1.0, 0.3)
        eager[1].bias.normal_(0.0, 0.3)
        eager[2].weight.uniform_(0.05, 0.5)
    twin = copy.deepcopy(eager)
    return eager, twin, FusedConvBNAct.from_modules(*twin), shape


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("slopes", [1, 6])
@pytest.mark.parametrize("training", [True, False])
def test_matches_eager_forward_and_every_gradient(dim, slopes, training):
    eager, twin, fused, shape = _chain(dim, slopes)
    eager.train(training), fused.train(training)
    x = seeded(*shape, seed=1, dtype=torch.float64).requires_grad_(True)
    (out, grads), (ref, ref_grads) = run_fwd_bwd(fused, [x], list(twin.parameters())), run_fwd_bwd(
        eager, [x], list(eager.parameters()))
    assert_close_dtype(out, ref)
    assert grads[-1].shape == (slopes,)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")
    for got, want in zip(twin.buffers(), eager.buffers()):  # running statistics as eager's
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_eager_error(dtype):
    ref, _, _, shape = _chain(2, 6)
    eager, twin, fused, _ = _chain(2, 6, dtype)
    x64 = seeded(*shape, seed=2, dtype=torch.float64).to(dtype).double().requires_grad_(True)
    want, want_grads = run_fwd_bwd(ref, [x64], list(ref.parameters()))
    x = x64.detach().to(dtype).requires_grad_(True)
    (out, grads), (e_out, e_grads) = (run_fwd_bwd(fused, [x], list(twin.parameters())),
                                      run_fwd_bwd(eager, [x], list(eager.parameters())))
    assert_within_eager_error(out, e_out, want)
    for i, (g, e, r) in enumerate(zip(grads, e_grads, want_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_cpu_autocast_runs_the_prelu_in_its_dtype_as_eager():
    eager, twin, fused, shape = _chain(2, 6, torch.float32)
    x = seeded(*shape, seed=3).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out, grads), (ref, ref_grads) = (run_fwd_bwd(fused, [x], list(twin.parameters())),
                                          run_fwd_bwd(eager, [x], list(eager.parameters())))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.dtype == r.dtype == torch.float32
        assert_close_dtype(g, r, dtype=torch.bfloat16, msg=f"grad {i}")


def test_saves_no_bn_output_and_empty_batches_pass():
    eager, twin, fused, _ = _chain(2, 6, torch.float32)
    x = seeded(4, 3, 16, 16, seed=4, requires_grad=True)
    got = activation_bytes(lambda: fused(x).sum(), exclude=tuple(twin.parameters()))
    want = activation_bytes(lambda: eager(x).sum(), exclude=tuple(eager.parameters()))
    conv_out = 4 * 6 * 16 * 16 * 4
    assert want - got >= conv_out  # eager keeps the BN output for the PReLU; the op recomputes it
    empty = torch.empty(0, 3, 7, 9, requires_grad=True)
    out = fused(empty)
    out.sum().backward()
    assert out.shape == (0, 6, 7, 9) and empty.grad.shape == empty.shape
    assert torch.equal(twin[2].weight.grad, torch.zeros(6))


def test_reasons_state_dict_and_dtype():
    conv, bn = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6)
    ok, why = FusedConvBNAct.supports(conv, bn, nn.PReLU(4))
    assert not ok and why == "act (PReLU) has 4 parameters for conv.out_channels=6"
    ok, why = FusedConvBNAct.supports(conv, bn, nn.PReLU(), nn.MaxPool2d(2))
    assert not ok and why.startswith("maxpool after a PReLU is not supported")

    class Shifted(nn.PReLU):
        def forward(self, x):
            return super().forward(x) + 1

    assert not FusedConvBNAct.supports(conv, bn, Shifted())[0]
    fused = FusedConvBNAct.from_modules(conv, bn, nn.PReLU(6))
    assert "act.weight" in fused.state_dict() and "act=prelu" in repr(fused)
    with pytest.raises(TypeError, match=r"act \(PReLU\) weight is torch.float64"):
        FusedConvBNAct.from_modules(conv, bn, nn.PReLU(6).double())(seeded(2, 3, 5, 5))


# --------------------------------------------------------------------------- the kernels with a slope
needs_interpreter = pytest.mark.skipif(not triton_interpreter_ready(),
                                       reason="triton missing, or imported before TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("slopes", [1, 5])
def test_triton_kernels_with_a_slope_match_the_torch_path(training, slopes):
    y = seeded(2, 5, 6, 7, seed=5, scale=2.0) + 0.3
    weight, bias = seeded(5, seed=6).abs() + 0.5, seeded(5, seed=7, scale=0.3)
    slope = seeded(slopes, seed=8).abs() * 0.4 + 0.05
    grad = seeded(2, 5, 6, 7, seed=9)
    args = (weight, bias) if training else (None, None)
    results = []
    for fwd, bwd in ((K.bn_act_forward_torch, K.bn_act_backward_torch),
                     (T.bn_act_forward_triton, T.bn_act_backward_triton)):
        bufs = (torch.zeros(5), torch.ones(5)) if training else (None, None)
        out, mean, invstd, _ = fwd(y, *args, *bufs, training=training, momentum=0.1, eps=1e-5,
                                   act=K.Act("leaky_relu"), slope=slope)
        got = bwd(grad, y, *args, mean, invstd, None, training=training, eps=1e-5, act=K.Act("leaky_relu"),
                  slope=slope)
        results.append((out, *got))
    for i, (tri, ref) in enumerate(zip(results[1], results[0])):
        if ref is None:
            assert tri is None
            continue
        assert tri.shape == ref.shape, i
        assert_close_dtype(tri.float(), ref.float(), torch.float32, msg=f"value {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("training", [True, False])
def test_gpu_kernels_with_a_slope_match_the_torch_path(training):
    y = seeded(8, 64, 28, 28, seed=5, scale=2.0, device="cuda") + 0.3
    weight, bias = (seeded(64, seed=6).abs() + 0.5).cuda(), seeded(64, seed=7, scale=0.3).cuda()
    slope, grad = (seeded(64, seed=8).abs() * 0.4 + 0.05).cuda(), seeded(8, 64, 28, 28, seed=9, device="cuda")
    args = (weight, bias) if training else (None, None)
    results = []
    for fwd, bwd in ((K.bn_act_forward_torch, K.bn_act_backward_torch),
                     (T.bn_act_forward_triton, T.bn_act_backward_triton)):
        bufs = (torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")) if training else (None, None)
        out, mean, invstd, _ = fwd(y, *args, *bufs, training=training, momentum=0.1, eps=1e-5,
                                   act=K.Act("leaky_relu"), slope=slope)
        results.append((out, *bwd(grad, y, *args, mean, invstd, None, training=training, eps=1e-5,
                                  act=K.Act("leaky_relu"), slope=slope)))
    for i, (tri, ref) in enumerate(zip(results[1], results[0])):
        if ref is not None:
            torch.testing.assert_close(tri.float(), ref.float(), atol=1e-3, rtol=1e-3, msg=f"value {i}")
