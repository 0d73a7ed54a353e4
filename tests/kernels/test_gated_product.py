"""``act(gate) * up`` on two separate tensors (kernels.gated_mlp.gated_product_*): torch path and Triton kernels
against eager autograd, on views whose rows are strided (the halves of one tensor), transposed and empty inputs."""

import pytest
import torch
import torch.nn.functional as F

from opsnn_lab.kernels import gated_mlp as gm
from opsnn_lab.kernels import gelu_dropout, rng, triton_available
from opsnn_lab.testing import assert_close_dtype, reloaded, seeded

ACTS = ["gelu", "gelu_tanh", "quick_gelu", "silu", "relu"]


def _act(z, act):
    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t), "silu": F.silu, "relu": F.relu}[act](z)


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


def _check(fwd, bwd, gate, up, act):
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
def test_reference_matches_eager_autograd(act, layout):
    _check(gm.gated_product_fwd, gm.gated_product_bwd, *_inputs(layout), act)


def test_reference_keeps_channels_last():
    gate = seeded(2, 6, 5, 5, seed=1).to(memory_format=torch.channels_last)
    up = seeded(2, 6, 5, 5, seed=2).to(memory_format=torch.channels_last)
    out = gm.gated_product_fwd_reference(gate, up, "silu")
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close_dtype(out, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_low_precision_rounds_once(dtype, act):
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


def test_bad_arguments_name_the_argument():
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


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture(scope="module")
def interpreted():
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(rng, gelu_dropout, gm, TRITON_INTERPRET="1", OPSNN_BACKEND="triton") as module:
        yield module


@pytest.mark.parametrize("layout, act", [("halves", "silu"), ("transposed", "gelu"), ("empty", "silu"),
                                         ("vector", "quick_gelu"), ("tiles", "gelu_tanh"), ("halves", "relu")])
def test_triton_interpreter_matches_eager(interpreted, layout, act):
    _check(interpreted.gated_product_fwd, interpreted.gated_product_bwd, *_inputs(layout), act)


def test_triton_interpreter_bf16_no_further_from_fp64_than_eager(interpreted):
    gate, up = seeded(16, 40, seed=6, dtype=torch.bfloat16).chunk(2, -1)
    ref = F.silu(gate.double()) * up.double()
    eager_err = (F.silu(gate) * up).double().sub(ref).abs().max()
    fused_err = interpreted.gated_product_fwd(gate, up, "silu").double().sub(ref).abs().max()
    assert fused_err <= eager_err + torch.finfo(torch.bfloat16).eps * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_kernels_match_reference(dtype):
    gate, up = seeded(1151, 2 * 2816, seed=1, dtype=dtype, device="cuda").chunk(2, -1)
    grad = seeded(1151, 2816, seed=2, dtype=dtype, device="cuda")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(gm.gated_product_fwd(gate, up, "silu").double(),
                               gm.gated_product_fwd_reference(gate.double(), up.double(), "silu"), atol=tol, rtol=tol)
    for got, ref in zip(gm.gated_product_bwd(grad, gate, up, "silu"),
                        gm.gated_product_bwd_reference(grad.double(), gate.double(), up.double(), "silu")):
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
