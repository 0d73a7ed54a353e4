"""GroupNorm + activation kernels: the torch path against eager autograd (every activation, odd shapes, with
and without affine, one group and one group per channel, an empty batch); the Triton kernels under the
interpreter against the torch path, fixed-order sums (the same bits twice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opsnn_lab.kernels import bn_act_triton, triton_available
from opsnn_lab.kernels import group_norm_act as K
from opsnn_lab.kernels.bn_act_spec import ACTS, Act
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, reloaded, seeded

SHAPES = [((2, 12, 5, 7), 3), ((3, 8, 33), 4), ((1, 6, 2, 2), 6), ((2, 4, 3, 2, 5), 1)]


def _params(c, affine, dtype, seed=1):
    if not affine:
        return None, None
    return seeded(c, seed=seed, dtype=dtype) + 1.0, seeded(c, seed=seed + 1, dtype=dtype)


def _eager(x, weight, bias, groups, act):
    return act.forward(F.group_norm(x, groups, weight, bias, 1e-5), inplace=False)


def _check(fwd, bwd, shape, groups, act, affine, dtype=torch.float64):
    x = seeded(*shape, seed=3, dtype=dtype, scale=2.0) + 0.5
    weight, bias = _params(shape[1], affine, dtype)
    grad = seeded(*shape, seed=4, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias) if t is not None]
    ref = _eager(leaves[0], *(leaves[1:] if affine else (None, None)), groups, act)
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    out, mean, rstd = fwd(x, weight, bias, groups, 1e-5, act)
    assert_close_dtype(out, ref.detach())
    assert mean.shape == rstd.shape == (shape[0], groups)
    got = bwd(grad, x, weight, bias, mean, rstd, groups, act)
    for i, (g, r) in enumerate(zip([t for t in got if t is not None], ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")
    assert (got[1] is None) == (not affine)


@pytest.mark.parametrize("act", [Act(a) for a in ACTS] + [Act("leaky_relu", 0.2)], ids=[*ACTS, "leaky_0.2"])
@pytest.mark.parametrize("shape, groups", SHAPES)
def test_torch_path_matches_eager_autograd(act, shape, groups):
    _check(K.group_norm_act_forward_torch, K.group_norm_act_backward_torch, shape, groups, act, affine=True)


@pytest.mark.parametrize("shape, groups", SHAPES[:2])
def test_torch_path_without_affine(shape, groups):
    _check(K.group_norm_act_forward_torch, K.group_norm_act_backward_torch, shape, groups, Act("silu"),
           affine=False)


def test_empty_batch_and_unneeded_gradients():
    x, w, b = torch.empty(0, 4, 3, 3), torch.ones(4), torch.zeros(4)
    out, mean, rstd = K.group_norm_act_forward(x, w, b, 2, 1e-5, Act("silu"))
    assert out.shape == x.shape and mean.shape == (0, 2)
    gx, gw, gb, gs = K.group_norm_act_backward(torch.empty(0, 4, 3, 3), x, w, b, mean, rstd, 2, Act("silu"))
    assert gx.shape == x.shape and torch.equal(gw, torch.zeros(4)) and torch.equal(gb, torch.zeros(4))
    assert gs is None  # no PReLU, no slope gradient
    x = seeded(2, 4, 3, 3)
    out, mean, rstd = K.group_norm_act_forward(x, w, b, 2, 1e-5, Act("silu"))
    gx, gw, gb, gs = K.group_norm_act_backward(torch.ones_like(x), x, w, b, mean, rstd, 2, Act("silu"),
                                               need=(True, False, False))
    assert gx is not None and gw is None and gb is None and gs is None
    slope = torch.full((4,), 0.2)
    *_, gs = K.group_norm_act_backward(torch.ones_like(x), x, w, b, mean, rstd, 2, Act("leaky_relu"),
                                       need=(True, True, True, False), slope=slope)
    assert gs is None


def _check_prelu(fwd, bwd, shape, groups, slopes, dtype=torch.float64, act_dtype=None):
    """``prelu(group_norm(x), slope)`` and its four gradients against eager autograd; ``act_dtype``: the slope's
    (autocast's) dtype, the PReLU then running on the normalised values cast to it."""
    act_dtype = act_dtype or dtype
    x = seeded(*shape, seed=3, dtype=dtype, scale=2.0) + 0.3
    weight, bias = _params(shape[1], True, dtype)
    slope = (seeded(slopes, seed=9, dtype=torch.float64).abs() * 0.5 + 0.05).to(act_dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias, slope)]
    ref = F.prelu(F.group_norm(leaves[0], groups, leaves[1], leaves[2], 1e-5).to(act_dtype), leaves[3])
    grad = seeded(*shape, seed=4, dtype=act_dtype)
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    out, mean, rstd = fwd(x, weight, bias, groups, 1e-5, Act("leaky_relu"), slope)
    assert out.dtype == act_dtype
    assert_close_dtype(out, ref.detach())
    got = bwd(grad, x, weight, bias, mean, rstd, groups, Act("leaky_relu"), (True,) * 4, slope)
    assert got[3].shape == slope.shape and got[3].dtype == slope.dtype
    if act_dtype == dtype:
        for i, (g, r) in enumerate(zip(got, ref_grads)):
            assert_close_dtype(g, r, msg=f"grad {i}")
        return
    # in act_dtype eager rounds every product it sums: within twice its error against float64
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    ref64 = F.prelu(F.group_norm(exact[0], groups, exact[1], exact[2], 1e-5), exact[3])
    for i, (g, e, r) in enumerate(zip(got, ref_grads, torch.autograd.grad(ref64, exact, grad.double()))):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


@pytest.mark.parametrize("shape, groups, slopes", [((2, 12, 5, 7), 3, 12), ((3, 8, 33), 8, 1), ((2, 4, 3, 2, 5), 4, 4)])
def test_torch_path_prelu_matches_eager_autograd(shape, groups, slopes):
    _check_prelu(K.group_norm_act_forward_torch, K.group_norm_act_backward_torch, shape, groups, slopes)


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture(scope="module")
def interpreted():
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(bn_act_triton, K, TRITON_INTERPRET="1", OPSNN_BACKEND="triton") as module:
        yield module


@pytest.mark.parametrize("shape, groups, act", [((2, 12, 5, 7), 3, "silu"), ((3, 8, 33), 4, "gelu"),
                                                ((1, 6, 2, 2), 6, "relu"), ((2, 4, 40, 40), 2, "hardswish"),
                                                ((2, 4, 3, 2, 5), 1, "gelu_tanh"), ((2, 6, 7, 5), 3, "mish"),
                                                ((2, 4, 9, 4), 2, "elu"), ((2, 5, 3, 4, 3), 5, "leaky_relu")])
def test_triton_interpreter_matches_eager(interpreted, shape, groups, act):
    _check(interpreted.group_norm_act_forward_triton, interpreted.group_norm_act_backward_triton, shape, groups,
           Act(act), affine=True, dtype=torch.float32)


def test_triton_interpreter_without_affine_low_precision_and_empty(interpreted):
    _check(interpreted.group_norm_act_forward_triton, interpreted.group_norm_act_backward_triton, (2, 6, 4, 4), 3,
           Act("silu"), affine=False, dtype=torch.float32)
    x = seeded(2, 8, 6, 6, seed=5, dtype=torch.bfloat16)
    w, b = _params(8, True, torch.bfloat16)
    out, mean, rstd = interpreted.group_norm_act_forward_triton(x, w, b, 4, 1e-5, Act("silu"))
    ref = _eager(x.double(), w.double(), b.double(), 4, Act("silu"))
    eager_err = (_eager(x, w, b, 4, Act("silu")).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= 2 * eager_err + 2**-8 * ref.abs().max()
    empty = torch.empty(0, 4, 3, 3)
    out, mean, rstd = interpreted.group_norm_act_forward_triton(empty, None, None, 2, 1e-5, Act("silu"))
    gx, gw, gb, gs = interpreted.group_norm_act_backward_triton(empty, empty, None, None, mean, rstd, 2, Act("silu"))
    assert out.shape == gx.shape == empty.shape and gw is None and gb is None and gs is None
    slope = torch.full((4,), 0.25)
    out, mean, rstd = interpreted.group_norm_act_forward_triton(empty, None, None, 2, 1e-5, Act("leaky_relu"), slope)
    *_, gs = interpreted.group_norm_act_backward_triton(empty, empty, None, None, mean, rstd, 2, Act("leaky_relu"),
                                                        slope=slope)
    assert torch.equal(gs, torch.zeros(4))


@pytest.mark.parametrize("shape, groups, slopes", [((2, 6, 5, 7), 6, 6), ((2, 8, 33), 4, 1)])
def test_triton_interpreter_prelu_matches_eager(interpreted, shape, groups, slopes):
    _check_prelu(interpreted.group_norm_act_forward_triton, interpreted.group_norm_act_backward_triton, shape, groups,
                 slopes, dtype=torch.float32)


def test_triton_interpreter_prelu_in_autocasts_dtype(interpreted):
    """Under autocast the PReLU runs in bf16 on the fp32 normalised values rounded to it, as eager's autocast does."""
    _check_prelu(interpreted.group_norm_act_forward_triton, interpreted.group_norm_act_backward_triton, (2, 6, 5, 7), 6,
                 6, dtype=torch.float32, act_dtype=torch.bfloat16)
    _check_prelu(K.group_norm_act_forward_torch, K.group_norm_act_backward_torch, (2, 6, 5, 7), 6, 6,
                 dtype=torch.float32, act_dtype=torch.bfloat16)


def test_triton_interpreter_gives_the_same_bits_twice(interpreted):
    x, grad = seeded(3, 8, 9, 9, seed=6), seeded(3, 8, 9, 9, seed=7)
    w, b = _params(8, True, torch.float32)
    runs = []
    for _ in range(2):
        out, mean, rstd = interpreted.group_norm_act_forward_triton(x, w, b, 2, 1e-5, Act("silu"))
        runs.append((out, *interpreted.group_norm_act_backward_triton(grad, x, w, b, mean, rstd, 2, Act("silu"))[:3]))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels_match_the_torch_path(dtype):
    x = seeded(4, 320, 32, 32, seed=1, dtype=dtype, device="cuda")
    grad = seeded(4, 320, 32, 32, seed=2, dtype=dtype, device="cuda")
    w, b = (t.cuda() for t in _params(320, True, dtype))
    out, mean, rstd = K.group_norm_act_forward(x, w, b, 32, 1e-5, Act("silu"))
    ref, rmean, rrstd = K.group_norm_act_forward_torch(x, w, b, 32, 1e-5, Act("silu"))
    assert_close_dtype(out, ref)
    got = K.group_norm_act_backward(grad, x, w, b, mean, rstd, 32, Act("silu"))
    want = K.group_norm_act_backward_torch(grad, x, w, b, rmean, rrstd, 32, Act("silu"))
    for g, r in zip(got[:3], want[:3]):
        torch.testing.assert_close(g.float(), r.float(), atol=5e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
    slope = (seeded(320, seed=3).abs() * 0.4 + 0.05).to(dtype).cuda()  # a PReLU per channel
    out, mean, rstd = K.group_norm_act_forward(x, w, b, 32, 1e-5, Act("leaky_relu"), slope)
    ref, rmean, rrstd = K.group_norm_act_forward_torch(x, w, b, 32, 1e-5, Act("leaky_relu"), slope)
    assert_close_dtype(out, ref)
    got = K.group_norm_act_backward(grad, x, w, b, mean, rstd, 32, Act("leaky_relu"), slope=slope)
    want = K.group_norm_act_backward_torch(grad, x, w, b, rmean, rrstd, 32, Act("leaky_relu"), slope=slope)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.float(), r.float(), atol=5e-2 if dtype == torch.bfloat16 else 1e-3, rtol=1e-2)
