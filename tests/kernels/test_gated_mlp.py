
import pytest
import torch
import torch.nn.functional as F

from opsnn_lab.kernels import gated_mlp as gm
from opsnn_lab.kernels import gelu_dropout, rng, triton_available
from opsnn_lab.testing import assert_close_dtype, reloaded, seeded

ACTS = ["gelu", "gelu_tanh", "quick_gelu", "silu", "relu"]


def _act(z, act):
    """Activations written as the models write them (HF ACT2FN modules / torch.nn.functional)."""
    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t), "silu": F.silu, "relu": F.relu}[act](z)


def _eager(gu, act, p, seed, offset, gate_first=True):
    g, u = gu.chunk(2, dim=1) if gate_first else gu.chunk(2, dim=1)[::-1]
    out = _act(g, act) * u
    if p > 0:
        out = out * rng.dropout_mask(seed, offset, out.shape, p, out.device) * (0.0 if p == 1 else 1 / (1 - p))
    return out


def _check(fwd, bwd, m, i, act, p, dtype=torch.float32, gate_first=True):
    gu = seeded(m, 2 * i, seed=1, dtype=dtype)
    grad = seeded(m, i, seed=2, dtype=dtype)
    ref_in = gu.clone().requires_grad_(True)
    ref = _eager(ref_in, act, p, 5, 2**32 + 7, gate_first)
    ref.backward(grad)
    out = fwd(gu, act, p, 5, 2**32 + 7, gate_first=gate_first)
    assert_close_dtype(out, ref.detach())
    grad_gu, again = bwd(grad, gu, act, p, 5, 2**32 + 7, want_out=True, gate_first=gate_first)
    assert_close_dtype(grad_gu, ref_in.grad)  # packed as gu is
    assert_close_dtype(again, out)
    assert bwd(grad, gu, act, p, 5, 2**32 + 7, gate_first=gate_first)[1] is None


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("gate_first", [True, False])
def test_reference_matches_eager_autograd(act, p, gate_first):
    _check(gm.gated_act_fwd_reference, gm.gated_act_bwd_reference, 13, 21, act, p, gate_first=gate_first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_public_entry_points_on_cpu_with_non_contiguous_gu(dtype):
    gu = seeded(7, 22, seed=3, dtype=dtype).t().contiguous().t()  # column-major
    assert not gu.is_contiguous()
    assert_close_dtype(gm.gated_act_fwd(gu, "silu"), _eager(gu, "silu", 0.0, 0, 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "quick_gelu"])
def test_low_precision_rounds_once(dtype, act):
    # computed in fp32 and rounded once: never further from fp64 than eager's op-by-op rounding
    gu = seeded(64, 96, seed=4, dtype=dtype)
    grad = seeded(64, 48, seed=5, dtype=dtype)
    ref = _eager(gu.double(), act, 0.0, 0, 0)
    eager_err = (_eager(gu, act, 0.0, 0, 0).double() - ref).abs().max()
    fused_err = (gm.gated_act_fwd(gu, act).double() - ref).abs().max()
    assert fused_err <= eager_err + torch.finfo(dtype).eps * ref.abs().max()
    g64 = gu.double().requires_grad_(True)
    _eager(g64, act, 0.0, 0, 0).backward(grad.double())
    grad_gu, _ = gm.gated_act_bwd(grad, gu, act)
    torch.testing.assert_close(grad_gu.double(), g64.grad, atol=4e-2, rtol=2e-2)


def test_empty_batch():
    out = gm.gated_act_fwd(torch.empty(0, 6), "silu", 0.5, 1, 0)
    grad_gu, again = gm.gated_act_bwd(torch.empty(0, 3), torch.empty(0, 6), "silu", 0.5, 1, 0, want_out=True)
    assert out.shape == again.shape == (0, 3) and grad_gu.shape == (0, 6)


def test_bad_arguments_name_the_argument():
    gu = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="act"):
        gm.gated_act_fwd(gu, "swish")
    with pytest.raises(ValueError, match="gu"):
        gm.gated_act_fwd(torch.zeros(3, 7), "silu")
    with pytest.raises(ValueError, match="gu"):
        gm.gated_act_fwd(torch.zeros(8), "silu")
    with pytest.raises(TypeError, match="gu"):
        gm.gated_act_fwd(gu.int(), "silu")
    with pytest.raises(ValueError, match="p"):
        gm.gated_act_fwd(gu, "silu", p=-0.1)
    with pytest.raises(ValueError, match="grad_out"):
        gm.gated_act_bwd(torch.zeros(3, 8), gu, "silu")
    with pytest.raises(TypeError, match="grad_out"):
        gm.gated_act_bwd(torch.zeros(3, 4, dtype=torch.float64), gu, "silu")
    with pytest.raises(TypeError, match="gate_first"):
        gm.gated_act_fwd(gu, "silu", gate_first=1)


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture(scope="module")
def interpreted():
    """gated_mlp (and the activation helpers it imports) reloaded under TRITON_INTERPRET=1, OPSNN_BACKEND=triton."""
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(rng, gelu_dropout, gm, TRITON_INTERPRET="1", OPSNN_BACKEND="triton") as module:
        yield module


# 10 x 1030 product columns: two row groups (8 rows each) and two column tiles (1024 each), both partial.
@pytest.mark.parametrize("m, i, act, p, gate_first", [
    (5, 37, "silu", 0.3, True),
    (5, 37, "gelu", 0.0, True),
    (5, 37, "gelu", 0.3, False),  # diffusers' GEGLU: [up | gate]
    (4, 9, "gelu_tanh", 0.2, True),
    (3, 8, "quick_gelu", 0.0, True),
    (3, 8, "relu", 1.0, True),
    (10, 1030, "silu", 0.25, True),
    (10, 1030, "silu", 0.25, False),
])
def test_triton_interpreter_matches_eager(interpreted, m, i, act, p, gate_first):
    _check(interpreted.gated_act_fwd, interpreted.gated_act_bwd, m, i, act, p, gate_first=gate_first)


def test_triton_interpreter_mask_bits_equal_torch_path(interpreted):
    gu = torch.full((6, 22), 50.0)  # silu(50) * 50 is exact, so the output reveals the mask
    out = interpreted.gated_act_fwd(gu, "silu", 0.5, 3, 12345)
    assert torch.equal(out != 0, rng.dropout_mask(3, 12345, (6, 11), 0.5))
    assert torch.equal(out, gm.gated_act_fwd_reference(gu, "silu", 0.5, 3, 12345))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gpu_kernels_match_reference(dtype, act):
    gu = seeded(1151, 2 * 2816, seed=1, dtype=dtype, device="cuda")
    grad = seeded(1151, 2816, seed=2, dtype=dtype, device="cuda")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    out = gm.gated_act_fwd(gu, act, 0.1, 9, 77)
    torch.testing.assert_close(out.double(), gm.gated_act_fwd_reference(gu.double(), act, 0.1, 9, 77),
                               atol=tol, rtol=tol)
    grad_gu, again = gm.gated_act_bwd(grad, gu, act, 0.1, 9, 77, want_out=True)
    ref, _ = gm.gated_act_bwd_reference(grad.double(), gu.double(), act, 0.1, 9, 77)
    torch.testing.assert_close(grad_gu.double(), ref, atol=tol, rtol=tol)
    assert torch.equal(again, out)


# --------------------------------------------------------------------------- act(gate) * up on two tensors
# kernels.gated_mlp.gated_product_*: the same kernels on two separate tensors, against eager autograd, on views
# whose rows are strided (the halves of one tensor), transposed and empty inputs.
def _inputs(layout, dtype=torch.float32):
    """(gate, up) in one of the layouts models hand the product."""
    if layout == "halves":  # gate, up = proj(x).chunk(2, -1): rows strided by 2I
        return seeded(3, 5, 74, seed=1, dtype=dtype).chunk(2, -1)
    if layout == "transposed":  # column-major 2-D views
        return (seeded(9, 13, seed=1, dtype=dtype).t(), seeded(9, 13, seed=2, dtype=dtype).t())
    if layout == "empty":
        return torch.empty(0, 7, dtype=dtype), torch.empty(0, 7, dtype=dtype)
    if layout == "vector":
        return seeded(11, seed=1, dtype=dtype), seeded(11, seed=2, dtype=dtype)
    return seeded(2, 3, 1030, seed=1, dtype=dtype), seeded(2, 3, 1030, seed=2, dtype=dtype)  # two column tiles


def _check_product(fwd, bwd, gate, up, act):
    grad = seeded(*gate.shape, seed=3, dtype=gate.dtype) if gate.numel() else torch.empty_like(gate)
    g, u = gate.detach().clone().requires_grad_(True), up.detach().clone().requires_grad_(True)
    ref = _act(g, act) * u
    ref.backward(grad)
    out = fwd(gate, up, act)
    assert out.shape == gate.shape and out.dtype == gate.dtype
    assert_close_dtype(out, ref.detach())
    dg, du = bwd(grad, gate, up, act)
    assert_close_dtype(dg, g.grad)
    assert_close_dtype(du, u.grad)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", ["halves", "transposed", "empty", "vector", "tiles"])
def test_product_matches_eager_autograd(act, layout):
    _check_product(gm.gated_product_fwd, gm.gated_product_bwd, *_inputs(layout), act)


def test_product_reference_keeps_channels_last():
    gate = seeded(2, 6, 5, 5, seed=1).to(memory_format=torch.channels_last)
    up = seeded(2, 6, 5, 5, seed=2).to(memory_format=torch.channels_last)
    out = gm.gated_product_fwd_reference(gate, up, "silu")
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close_dtype(out, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_product_low_precision_rounds_once(dtype, act):
    gate, up = seeded(64, 96, seed=4, dtype=dtype).chunk(2, -1)
    ref = _act(gate.double(), act) * up.double()
    eager_err = (_act(gate, act) * up).double().sub(ref).abs().max()
    fused_err = gm.gated_product_fwd(gate, up, act).double().sub(ref).abs().max()
    assert fused_err <= eager_err + torch.finfo(dtype).eps * ref.abs().max()
    grad = seeded(64, 48, seed=5, dtype=dtype)
    g64, u64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    (_act(g64, act) * u64).backward(grad.double())
    dg, du = gm.gated_product_bwd(grad, gate, up, act)
    torch.testing.assert_close(dg.double(), g64.grad, atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(du.double(), u64.grad, atol=4e-2, rtol=2e-2)


def test_product_bad_arguments_name_the_argument():
    gate = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="act"):
        gm.gated_product_fwd(gate, gate, "swish")
    with pytest.raises(ValueError, match="up"):
        gm.gated_product_fwd(gate, torch.zeros(3, 4), "silu")
    with pytest.raises(TypeError, match="up"):
        gm.gated_product_fwd(gate, gate.double(), "silu")
    with pytest.raises(TypeError, match="gate"):
        gm.gated_product_fwd(gate.int(), gate.int(), "silu")
    with pytest.raises(TypeError, match="gate"):
        gm.gated_product_fwd([1.0], gate, "silu")
    with pytest.raises(ValueError, match="grad_out"):
        gm.gated_product_bwd(torch.zeros(3, 4), gate, gate, "silu")
    with pytest.raises(TypeError, match="grad_out"):
        gm.gated_product_bwd(gate.double(), gate, gate, "silu")


@pytest.mark.parametrize("layout, act", [("halves", "silu"), ("transposed", "gelu"), ("empty", "silu"),
                                         ("vector", "quick_gelu"), ("tiles", "gelu_tanh"), ("halves", "relu")])
def test_product_triton_interpreter_matches_eager(interpreted, layout, act):
    _check_product(interpreted.gated_product_fwd, interpreted.gated_product_bwd, *_inputs(layout), act)


def test_product_triton_interpreter_bf16_no_further_from_fp64_than_eager(interpreted):
    gate, up = seeded(16, 40, seed=6, dtype=torch.bfloat16).chunk(2, -1)
    ref = F.silu(gate.double()) * up.double()
    eager_err = (F.silu(gate) * up).double().sub(ref).abs().max()
    fused_err = interpreted.gated_product_fwd(gate, up, "silu").double().sub(ref).abs().max()
    assert fused_err <= eager_err + torch.finfo(torch.bfloat16).eps * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_product_gpu_kernels_match_reference(dtype):
    gate, up = seeded(1151, 2 * 2816, seed=1, dtype=dtype, device="cuda").chunk(2, -1)
    grad = seeded(1151, 2816, seed=2, dtype=dtype, device="cuda")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(gm.gated_product_fwd(gate, up, "silu").double(),
                               gm.gated_product_fwd_reference(gate.double(), up.double(), "silu"), atol=tol, rtol=tol)
    for got, ref in zip(gm.gated_product_bwd(grad, gate, up, "silu"),
                        gm.gated_product_bwd_reference(grad.double(), gate.double(), up.double(), "silu")):
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
