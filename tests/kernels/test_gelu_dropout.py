
import pytest
import torch
import torch.nn.functional as F

from opsnn_lab.kernels import gelu_dropout as gd
from opsnn_lab.kernels import rng, triton_available
from opsnn_lab.testing import assert_close_dtype, reloaded, seeded


def _eager(h, bias, p, seed, offset, approximate):
    """Autograd over plain torch ops with the same counter-based mask: the oracle of both paths."""
    z = h if bias is None else h + bias
    out = F.gelu(z, approximate=approximate)
    if p > 0:
        keep = rng.dropout_mask(seed, offset, z.shape, p, z.device)
        out = out * keep * (0.0 if p == 1 else 1.0 / (1 - p))
    return out


def _check_against_eager(fwd, bwd, m, n, p, approximate, with_bias, dtype=torch.float32, device="cpu"):
    a = seeded(m, n, seed=1, dtype=dtype, device=device)
    b = seeded(n, seed=2, dtype=dtype, device=device) if with_bias else None
    g = seeded(m, n, seed=3, dtype=dtype, device=device)
    a_ref = a.clone().requires_grad_(True)
    b_ref = None if b is None else b.clone().requires_grad_(True)
    ref = _eager(a_ref, b_ref, p, 7, 2**32 + 1, approximate)
    ref.backward(g)
    out, h = fwd(a.clone(), p, 7, 2**32 + 1, approximate, bias=b)
    assert_close_dtype(out, ref.detach())
    assert_close_dtype(h, a if b is None else a + b)
    grad_h, grad_b, again = bwd(g, h, p, 7, 2**32 + 1, approximate, want_bias=True, want_out=True)
    assert_close_dtype(grad_h, a_ref.grad)
    assert torch.equal(again, out)  # recomputed output: same bits as the forward's
    if b_ref is not None:
        assert_close_dtype(grad_b, b_ref.grad, msg="bias grad")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_matches_eager_autograd(approximate, p, with_bias):
    _check_against_eager(gd.gelu_dropout_fwd_reference, gd.gelu_dropout_bwd_reference, 33, 81, p, approximate,
                         with_bias)


@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-10, 1e-10)])
def test_public_entry_points_on_cpu(dtype, atol, rtol):
    _check_against_eager(gd.gelu_dropout_fwd, gd.gelu_dropout_bwd, 9, 13, 0.5, "none", True, dtype=dtype)


def test_empty_batch():
    out, h = gd.gelu_dropout_fwd(torch.empty(0, 5), 0.5, 0, 0)
    grad_h, grad_b, _ = gd.gelu_dropout_bwd(torch.empty(0, 5), h, 0.5, 0, 0, want_bias=True)
    assert out.shape == grad_h.shape == (0, 5) and torch.equal(grad_b, torch.zeros(5))


def test_bad_arguments_name_the_argument():
    h = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="p"):
        gd.gelu_dropout_fwd(h, 1.5, 0, 0)
    with pytest.raises(ValueError, match="approximate"):
        gd.gelu_dropout_fwd(h, 0.1, 0, 0, approximate="fast")
    with pytest.raises(ValueError, match="h"):
        gd.gelu_dropout_fwd(torch.zeros(3), 0.1, 0, 0)
    with pytest.raises(TypeError, match="h"):
        gd.gelu_dropout_fwd(torch.zeros(3, 4, dtype=torch.int32), 0.1, 0, 0)
    with pytest.raises(ValueError, match="bias"):
        gd.gelu_dropout_fwd(h, 0.1, 0, 0, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="grad_out"):
        gd.gelu_dropout_bwd(torch.zeros(4, 3), h, 0.1, 0, 0)
    with pytest.raises(TypeError, match="grad_out"):
        gd.gelu_dropout_bwd(h.double(), h, 0.1, 0, 0)


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture(scope="module")
def interpreted():
    """gelu_dropout reloaded under TRITON_INTERPRET=1 with OPSNN_BACKEND=triton, restored afterwards."""
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(rng, gd, TRITON_INTERPRET="1", OPSNN_BACKEND="triton") as module:
        yield module


# 17 x 1030: two row groups (16 rows each) and two column tiles (1024 each), both partially filled.
@pytest.mark.parametrize("m, n, p, approximate, with_bias", [
    (5, 37, 0.3, "none", True),
    (5, 37, 0.3, "tanh", False),
    (4, 9, 0.0, "tanh", True),
    (3, 8, 1.0, "none", True),
    (17, 1030, 0.25, "none", True),
])
def test_triton_interpreter_matches_eager(interpreted, m, n, p, approximate, with_bias):
    _check_against_eager(interpreted.gelu_dropout_fwd, interpreted.gelu_dropout_bwd, m, n, p, approximate, with_bias)


def test_triton_interpreter_mask_bits_equal_torch_path(interpreted):
    ones = torch.ones(6, 11)
    # gelu(large) == large, so the output reveals the mask: kept elements are exactly 2 * 50.
    out, _ = interpreted.gelu_dropout_fwd(ones * 50, 0.5, 3, 12345, "none")
    keep = rng.dropout_mask(3, 12345, (6, 11), 0.5)
    assert torch.equal(out != 0, keep)


def test_triton_interpreter_fp16_and_deterministic_bias_grad(interpreted):
    h = seeded(5, 37, seed=4, dtype=torch.float16)
    g = seeded(5, 37, seed=5, dtype=torch.float16)
    first = interpreted.gelu_dropout_bwd(g, h, 0.2, 1, 0, want_bias=True)
    second = interpreted.gelu_dropout_bwd(g, h, 0.2, 1, 0, want_bias=True)
    assert torch.equal(first[1], second[1])
    ref = gd.gelu_dropout_bwd_reference(g.double(), h.double(), 0.2, 1, 0, want_bias=True)
    torch.testing.assert_close(first[0].double(), ref[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(first[1].double(), ref[1], atol=1e-2, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_interpreter_forward_equals_the_backward_recompute_with_a_bias(interpreted, dtype):
    """The activation reads h + bias as stored (rounded to the dtype), as eager and the backward's recompute
    do, so ``want_out`` gives the forward's bits; and the bias gradient does not depend on ``want_out``."""
    a, b, g = (seeded(*shape, seed=s, dtype=dtype) for shape, s in (((17, 40), 1), ((40,), 2), ((17, 40), 3)))
    out, h = interpreted.gelu_dropout_fwd(a.clone(), 0.1, 9, 77, "tanh", bias=b)
    torch.testing.assert_close(h, a + b)  # (the interpreter's bf16 cast truncates; a GPU rounds to nearest)
    _, grad_b, again = interpreted.gelu_dropout_bwd(g, h, 0.1, 9, 77, "tanh", want_bias=True, want_out=True)
    assert torch.equal(again, out)
    assert torch.equal(interpreted.gelu_dropout_bwd(g, h, 0.1, 9, 77, "tanh", want_bias=True)[1], grad_b)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gpu_kernels_match_reference(dtype, approximate):
    m, n = 1151, 3072
    a = seeded(m, n, seed=1, dtype=dtype, device="cuda")
    b = seeded(n, seed=2, dtype=dtype, device="cuda")
    g = seeded(m, n, seed=3, dtype=dtype, device="cuda")
    out, h = gd.gelu_dropout_fwd(a.clone(), 0.1, 9, 77, approximate, bias=b)
    ref_out, _ = gd.gelu_dropout_fwd_reference(a.double(), 0.1, 9, 77, approximate, bias=b.double())
    torch.testing.assert_close(out.double(), ref_out, **_gpu_tol(dtype))
    torch.testing.assert_close(h, (a.float() + b.float()).to(dtype), atol=0, rtol=0)
    grad_h, grad_b, again = gd.gelu_dropout_bwd(g, h, 0.1, 9, 77, approximate, want_bias=True, want_out=True)
    ref = gd.gelu_dropout_bwd_reference(g.double(), h.double(), 0.1, 9, 77, approximate, want_bias=True)
    torch.testing.assert_close(grad_h.double(), ref[0], **_gpu_tol(dtype))
    torch.testing.assert_close(grad_b.double(), ref[1], atol=_gpu_tol(dtype)["atol"] * m ** 0.5, rtol=1e-2)
    assert torch.equal(again, out)  # the activation reads h + bias as stored, in the forward and the recompute
    again_b = gd.gelu_dropout_bwd(g, h, 0.1, 9, 77, approximate, want_bias=True, want_out=True)[1]
    assert torch.equal(again_b, grad_b)  # two-stage fixed-order reduction: same bits every run
    # Without want_out the kernel is compiled apart, and the compiler may contract act'(h)'s arithmetic
    # otherwise (seen on an H200): the same sums to rounding, not always the same bits.
    other_b = gd.gelu_dropout_bwd(g, h, 0.1, 9, 77, approximate, want_bias=True)[1]
    torch.testing.assert_close(other_b, grad_b, atol=_gpu_tol(dtype)["atol"] * m ** 0.5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_mask_bits_equal_cpu_torch_path():
    out, _ = gd.gelu_dropout_fwd(torch.full((1151, 3072), 50.0, device="cuda"), 0.1, 5, 2**33 + 3)
    assert torch.equal((out != 0).cpu(), rng.dropout_mask(5, 2**33 + 3, (1151, 3072), 0.1))


def _gpu_tol(dtype):
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]


# --------------------------------------------------------------------------- every activation
_ACT_EAGER = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
              "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t), "silu": F.silu, "relu": F.relu}


def _check_act(fwd, bwd, m, n, p, act, with_bias):
    a, b, g = seeded(m, n, seed=1), seeded(n, seed=2) if with_bias else None, seeded(m, n, seed=3)
    a_ref = a.clone().requires_grad_(True)
    b_ref = None if b is None else b.clone().requires_grad_(True)
    z = a_ref if b_ref is None else a_ref + b_ref
    ref = _ACT_EAGER[act](z)
    if p > 0:
        ref = ref * rng.dropout_mask(7, 99, z.shape, p) * (0.0 if p == 1 else 1 / (1 - p))
    ref.backward(g)
    out, h = fwd(a.clone(), p, 7, 99, act, bias=b)
    assert_close_dtype(out, ref.detach())
    grad_h, grad_b, again = bwd(g, h, p, 7, 99, act, want_bias=True, want_out=True)
    assert_close_dtype(grad_h, a_ref.grad)
    assert torch.equal(again, out)
    if b_ref is not None:
        assert_close_dtype(grad_b, b_ref.grad, msg="bias grad")


@pytest.mark.parametrize("act", list(_ACT_EAGER))
@pytest.mark.parametrize("p, with_bias", [(0.0, False), (0.3, True)])
def test_every_activation_reference_matches_eager(act, p, with_bias):
    _check_act(gd.act_dropout_fwd_reference, gd.act_dropout_bwd_reference, 19, 45, p, act, with_bias)


@pytest.mark.parametrize("act", ["quick_gelu", "silu", "relu"])
def test_every_activation_triton_interpreter_matches_eager(interpreted, act):
    _check_act(interpreted.act_dropout_fwd, interpreted.act_dropout_bwd, 5, 37, 0.3, act, True)


def test_activation_names_are_checked():
    with pytest.raises(ValueError, match="act"):
        gd.act_dropout_fwd(torch.zeros(2, 3), 0.0, 0, 0, act="swish")
    with pytest.raises(ValueError, match="approximate"):
        gd.gelu_dropout_bwd(torch.zeros(2, 3), torch.zeros(2, 3), 0.0, 0, 0, approximate="gelu")
