"""FusedDropoutLinear: ``linear(dropout(x))`` saving x only, against eager with the same counter mask in outputs
and every gradient, fp32 / bf16 / fp16, odd and non-contiguous inputs, the bytes it saves, its RNG contract and
bad arguments."""

import pytest
import torch
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import Dropout, FusedDropoutLinear
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, run_fwd_bwd, seeded


def _linear(n_in=13, n_out=7, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias).to(dtype)


def _eager(lin, p, seed=11, step=0):
    """The unfused pair, nn.Dropout's mask replaced by the counter mask the op draws."""
    def fn(x):
        keep = rng.dropout_mask(seed, step * rng.MAX_NUMEL, x.shape, p, x.device, dtype=x.dtype)
        return lin(x * keep * (0.0 if p == 1 else 1.0 / (1 - p)))
    return fn


def _params(lin):
    return [t for t in (lin.weight, lin.bias) if t is not None]


@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_eager_in_every_gradient(p, bias):
    lin = _linear(bias=bias)
    op = FusedDropoutLinear(lin, p, seed=11)
    x = seeded(3, 5, 13, seed=1).requires_grad_(True)
    out, grads = run_fwd_bwd(op, [x], _params(lin))
    ref, ref_grads = run_fwd_bwd(_eager(lin, p), [x], _params(lin))
    assert_close_dtype(out, ref)
    assert len(grads) == len(ref_grads) == 1 + len(_params(lin))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_eager_error(dtype):
    lin, lin64 = _linear(97, 33, dtype=dtype), _linear(97, 33, dtype=torch.float64)
    x = seeded(41, 97, seed=2, dtype=dtype).requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    out, grads = run_fwd_bwd(FusedDropoutLinear(lin, 0.2, seed=11), [x], _params(lin))
    eager, eager_grads = run_fwd_bwd(_eager(lin, 0.2), [x], _params(lin))
    ref, ref_grads = run_fwd_bwd(_eager(lin64, 0.2), [x64], _params(lin64))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


@pytest.mark.parametrize("shape", [(0, 13), (13,), (2, 3, 4, 13)])
def test_odd_shapes_and_non_contiguous_input(shape):
    lin = _linear()
    for x in (seeded(*shape, seed=3) if shape[0] else torch.empty(shape), non_contiguous(seeded(6, 13, seed=4))):
        x = x.requires_grad_(True)
        out, grads = run_fwd_bwd(FusedDropoutLinear(lin, 0.3, seed=11), [x], _params(lin))
        ref, ref_grads = run_fwd_bwd(_eager(lin, 0.3), [x], _params(lin))
        assert out.shape == ref.shape
        assert_close_dtype(out, ref)
        for g, r in zip(grads, ref_grads):
            assert_close_dtype(g, r)


def test_saves_x_not_the_mask_or_the_dropped_copy():
    lin = _linear(64, 8)
    x = seeded(32, 64, seed=5).requires_grad_(True)
    drop = nn.Dropout(0.1)
    eager = activation_bytes(lambda: lin(drop(x)))
    fused = activation_bytes(lambda: FusedDropoutLinear(lin, 0.1, seed=1)(x))
    # eager: the dropped copy and the mask (bool where dropout is native_dropout, a float noise tensor on CPU)
    assert eager >= 32 * 64 * (4 + 1) and fused == 32 * 64 * 4
    twice = activation_bytes(lambda: (FusedDropoutLinear(lin, 0.1, seed=1)(x), FusedDropoutLinear(lin, 0.1, seed=2)(x)))
    assert twice == fused  # two adapters reading one x keep it once


def test_counter_stream_contract():
    lin = _linear()
    op = FusedDropoutLinear.from_modules(Dropout(0.25, seed=5), lin)
    assert op.rng_seed == 5 and op.p == 0.25 and op.training
    x = seeded(4, 13, seed=6)
    a, b = op(x), op(x)
    assert op.rng_step == 2 and not torch.equal(a, b)  # one draw per training call
    op.set_rng(5, 0)
    assert torch.equal(op(x), a)
    op.eval()
    assert torch.equal(op(x), lin(x)) and op.rng_step == 1  # eval: the Linear alone, no draw
    zero = FusedDropoutLinear(lin, 0.0, seed=1)
    assert torch.equal(zero(x), lin(x)) and zero.rng_step == 1  # p = 0 still draws (steps stay aligned)
    assert list(FusedDropoutLinear(lin, 0.1, register=False).state_dict()) == []


def test_autocast_computes_what_autocast_computes():
    lin = _linear(16, 8)
    x = seeded(5, 16, seed=7).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = FusedDropoutLinear(lin, 0.2, seed=11)(x)
        ref = _eager(lin, 0.2)(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
    out.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32


def test_bad_arguments_name_the_argument():
    lin = _linear()
    with pytest.raises(TypeError, match="linear"):
        FusedDropoutLinear(nn.Conv1d(3, 3, 1), 0.1)
    with pytest.raises(ValueError, match="p"):
        FusedDropoutLinear(lin, 1.5)
    with pytest.raises(TypeError, match="dropout"):
        FusedDropoutLinear.from_modules(nn.Identity(), lin)
    assert FusedDropoutLinear.supports(nn.Dropout(0.1), lin) == (True, "")
    op = FusedDropoutLinear(lin, 0.1)
    with pytest.raises(TypeError, match="x"):
        op(torch.zeros(3, 13, dtype=torch.float64))
    with pytest.raises(TypeError, match="x"):
        op([0.0] * 13)
    with pytest.raises(ValueError, match="x"):  # input check before the draw: nothing advanced
        op(torch.zeros(3, 12))
    with pytest.raises(ValueError, match="2\\*\\*32"):  # more elements than one draw numbers (a free view)
        op(torch.zeros(1, 13).expand(2**29, 13))
    assert op.rng_step == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_eager_with_the_same_mask(dtype):
    lin = _linear(1024, 16, dtype=dtype).cuda()  # a LoRA lora_A at Llama width / 4
    x = seeded(512, 1024, seed=8, dtype=dtype, device="cuda").requires_grad_(True)
    out, grads = run_fwd_bwd(FusedDropoutLinear(lin, 0.05, seed=11), [x], _params(lin))
    ref, ref_grads = run_fwd_bwd(_eager(lin, 0.05), [x], _params(lin))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)
