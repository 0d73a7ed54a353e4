import pytest
import torch

from opsnn_lab.kernels import norm as K
from opsnn_lab.testing import seeded, triton_interpreter_ready


def _eager(s, weight, bias, eps, rms, offset):
    w = None if weight is None else weight + offset
    if rms:
        return torch.nn.functional.rms_norm(s, (s.shape[-1],), w, eps) + (0 if bias is None else bias)
    return torch.nn.functional.layer_norm(s, (s.shape[-1],), w, bias, eps)


def _check(fwd, bwd, m, n, rms, residual, affine=True, offset=0.0, dtype=torch.float32, tol=1e-5):
    x = seeded(m, n, seed=1, dtype=dtype, scale=3.0) + 0.5
    r = seeded(m, n, seed=2, dtype=dtype) if residual else None
    w = seeded(n, seed=3, dtype=dtype) if affine else None
    b = seeded(n, seed=4, dtype=dtype) if affine else None
    gy, gs = seeded(m, n, seed=5, dtype=dtype), seeded(m, n, seed=6, dtype=dtype) if residual else None
    leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b) if t is not None]
    xe, re_ = leaves[0], leaves[1] if residual else None
    we, be = (leaves[-2], leaves[-1]) if affine else (None, None)
    se = xe if re_ is None else xe + re_
    ye = _eager(se, we, be, 1e-5, rms, offset)
    outs, grads = [ye], [gy]
    if residual:
        outs, grads = [ye, se], [gy, gs]
    torch.autograd.backward(outs, grads)
    y, s, mean, rstd = fwd(x, w, b, r, 1e-5, rms, offset)
    torch.testing.assert_close(y, ye.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(s, se.detach(), atol=0, rtol=0)  # the sum is rounded once, as eager's add
    assert rstd.shape == (m,) and rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert (mean is None) == rms
    grad_s, grad_w, grad_b = bwd(gy, s, mean, rstd, w, rms, offset, affine, gs)
    torch.testing.assert_close(grad_s, xe.grad, atol=tol, rtol=tol)
    if residual:
        torch.testing.assert_close(grad_s, re_.grad, atol=tol, rtol=tol)
    if affine:
        torch.testing.assert_close(grad_w, we.grad, atol=tol * m, rtol=tol)
        torch.testing.assert_close(grad_b, be.grad, atol=tol * m, rtol=tol)
    else:
        assert grad_w is None and grad_b is None


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_reference_matches_eager_autograd(rms, residual, offset):
    _check(K.norm_fwd_reference, K.norm_bwd_reference, 23, 37, rms, residual, offset=offset)


@pytest.mark.parametrize("rms", [False, True])
def test_public_entry_points_without_affine_and_in_fp64(rms):
    _check(K.norm_fwd, K.norm_bwd, 5, 13, rms, True, affine=False)
    _check(K.norm_fwd, K.norm_bwd, 5, 13, rms, False, dtype=torch.float64, tol=1e-10)


def test_empty_batch():
    for rms in (False, True):
        y, s, mean, rstd = K.norm_fwd(torch.empty(0, 6), torch.ones(6), None, torch.empty(0, 6), 1e-5, rms)
        grad_s, grad_w, _ = K.norm_bwd(torch.empty(0, 6), s, mean, rstd, torch.ones(6), rms)
        assert y.shape == grad_s.shape == (0, 6) and torch.equal(grad_w, torch.zeros(6))


def test_bad_arguments_name_the_argument():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="x"):
        K.norm_fwd(torch.zeros(4))
    with pytest.raises(TypeError, match="x"):
        K.norm_fwd(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="residual"):
        K.norm_fwd(x, residual=torch.zeros(3, 5))
    with pytest.raises(TypeError, match="residual"):
        K.norm_fwd(x, residual=x.double())
    with pytest.raises(ValueError, match="weight"):
        K.norm_fwd(x, torch.ones(5))
    with pytest.raises(ValueError, match="grad_y"):
        K.norm_bwd(torch.zeros(3, 5), x, None, torch.ones(3), rms=True)


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture
def triton_backend(monkeypatch):
    if not triton_interpreter_ready():
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")


# 35 rows: two full 16-row backward groups and a partial one; 37 / 1030 columns: a partly masked block.
@pytest.mark.parametrize("m, n, rms, residual, offset", [
    (35, 37, False, True, 0.0),
    (35, 37, True, True, 1.0),
    (3, 1030, False, False, 0.0),
    (3, 1030, True, False, 0.0),
])
def test_triton_interpreter_matches_eager(triton_backend, m, n, rms, residual, offset):
    _check(K.norm_fwd, K.norm_bwd, m, n, rms, residual, offset=offset, tol=2e-5)


def test_triton_interpreter_no_affine_and_deterministic_weight_grad(triton_backend):
    _check(K.norm_fwd, K.norm_bwd, 17, 9, True, True, affine=False)
    x, w, gy = seeded(33, 24, seed=1, dtype=torch.float16), seeded(24, seed=2, dtype=torch.float16), \
        seeded(33, 24, seed=3, dtype=torch.float16)
    _, s, mean, rstd = K.norm_fwd(x, w, None, None, 1e-5, False)
    first = K.norm_bwd(gy, s, mean, rstd, w, False, has_bias=True)
    second = K.norm_bwd(gy, s, mean, rstd, w, False, has_bias=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    ref = K.norm_bwd_reference(gy.double(), s.double(), mean.double(), rstd.double(), w.double(), False,
                               has_bias=True)
    for got, want in zip(first, ref):
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
def test_gpu_kernels_match_reference(dtype, rms):
    m, n = 1151, 4096
    x, r = seeded(m, n, seed=1, dtype=dtype, device="cuda"), seeded(m, n, seed=2, dtype=dtype, device="cuda")
    w, gy = seeded(n, seed=3, dtype=dtype, device="cuda"), seeded(m, n, seed=4, dtype=dtype, device="cuda")
    y, s, mean, rstd = K.norm_fwd(x, w, None, r, 1e-5, rms)
    ref = K.norm_fwd_reference(x.double(), w.double(), None, r.double(), 1e-5, rms)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(y.double(), ref[0], **tol)
    grads = K.norm_bwd(gy, s, mean, rstd, w, rms)
    want = K.norm_bwd_reference(gy.double(), s.double(), ref[2], ref[3], w.double(), rms)
    torch.testing.assert_close(grads[0].double(), want[0], **tol)
    assert torch.equal(K.norm_bwd(gy, s, mean, rstd, w, rms)[1], grads[1])


# --------------------------------------------------------------------------- backward from the output
def _check_from_output(m, n, rms, residual, offset=0.0, affine=True, dtype=torch.float32, tol=1e-5):
    """``norm_bwd_from_output(y, ...)`` gives ``norm_bwd(s, ...)``'s gradients, where the parameters allow it."""
    x = seeded(m, n, seed=1, dtype=dtype, scale=3.0) + 0.5
    r = seeded(m, n, seed=2, dtype=dtype) if residual else None
    w = (seeded(n, seed=3, dtype=dtype, scale=0.2) + (1.0 - offset)) if affine else None
    b = seeded(n, seed=4, dtype=dtype, scale=0.2) if affine else None
    gy, gs = seeded(m, n, seed=5, dtype=dtype), seeded(m, n, seed=6, dtype=dtype) if residual else None
    assert K.output_recoverable(w, b, offset, dtype)
    y, s, mean, rstd = K.norm_fwd(x, w, b, r, 1e-5, rms, offset)
    want = K.norm_bwd(gy, s, mean, rstd, w, rms, offset, affine, gs)
    got = K.norm_bwd_from_output(gy, y, rstd, w, b, rms, offset, want_bias=affine, grad_sum=gs)
    for g, e in zip(got, want):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e, atol=tol * max(1, m // 4), rtol=tol)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual, offset", [(False, 0.0), (True, 1.0)])
def test_backward_from_the_output_matches_backward_from_the_input(rms, residual, offset):
    _check_from_output(23, 37, rms, residual, offset)
    _check_from_output(5, 13, rms, residual, offset, affine=False)
    _check_from_output(5, 13, rms, residual, offset, dtype=torch.float64, tol=1e-10)


def test_output_recoverable_rules():
    w, b = torch.ones(4), torch.zeros(4)
    assert K.output_recoverable(w, b, 0.0, torch.float32) and K.output_recoverable(None, None, 0.0, torch.float16)
    assert not K.output_recoverable(torch.tensor([1.0, 0.0, 1.0, 1.0]), None, 0.0, torch.float32)  # 0/0
    assert not K.output_recoverable(torch.zeros(4), None, 1.0 - 1.0, torch.float32)
    assert K.output_recoverable(torch.zeros(4), None, 1.0, torch.float32)  # Gemma: (1 + 0) is the weight
    assert K.output_recoverable(w * 1e-3, None, 0.0, torch.float16)  # no bias: y / w keeps its relative error
    assert not K.output_recoverable(w * 1e-4, None, 0.0, torch.float16)  # y near fp16's subnormals
    edge = K.RECOVER_MAX_BIAS
    assert K.output_recoverable(w, b + edge, 0.0, torch.float32)
    assert not K.output_recoverable(w, b + 1.01 * edge, 0.0, torch.float32)
    assert not K.output_recoverable(w, b + float("nan"), 0.0, torch.float32)
    assert not K.output_recoverable(w * float("inf"), None, 0.0, torch.float32)
    assert not K.output_recoverable(torch.tensor([1.0, float("nan"), 1.0]), None, 0.0, torch.float32)
    assert not K.output_recoverable(w, b - float("inf"), 0.0, torch.float32)
    assert not K.output_recoverable(w, torch.tensor([0.0, 0.0, 0.0, -4.5]), 0.0, torch.float32)  # one column
    for dtype in (torch.bfloat16, torch.float16):  # the weight in its own dtype, the bias against it per column
        assert K.output_recoverable(w.to(dtype), (b + edge).to(dtype), 0.0, dtype)
        assert not K.output_recoverable(w.to(dtype), (b + 4.5).to(dtype), 0.0, dtype)
        assert K.output_recoverable((w - 1).to(dtype), None, 1.0, dtype)  # Gemma's (1 + 0)
        assert not K.output_recoverable(torch.full((4,), -1.0, dtype=dtype), None, 1.0, dtype)  # (1 - 1)
    assert K.output_recoverable(torch.ones(2, 3), torch.zeros(2, 3), 0.0, torch.float32)  # a 2-D normalized shape
    assert K.output_recoverable(torch.ones(0), None, 0.0, torch.float32)


@pytest.mark.parametrize("m, n, rms, residual, offset", [(35, 37, False, True, 0.0), (35, 37, True, False, 1.0),
                                                         (3, 1030, False, False, 0.0)])
def test_triton_interpreter_backward_from_the_output(triton_backend, m, n, rms, residual, offset):
    _check_from_output(m, n, rms, residual, offset, tol=2e-5)
    _check_from_output(17, 9, rms, residual, offset, affine=False, tol=2e-5)
