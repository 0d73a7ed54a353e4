"""FusedGroupNormAct: ``act(GroupNorm(x))`` against eager, every gradient, per dtype (fp16/bf16 within twice
eager's error against fp64); channels-last, non-contiguous and empty inputs; what it saves; autocast as eager;
bad arguments."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from opsnn_lab.measuring import activation_bytes
from opsnn_lab.ops import FusedGroupNormAct
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, run_fwd_bwd, seeded

ACTS = {"silu": nn.SiLU, "gelu": nn.GELU, "relu": nn.ReLU, "hardswish": nn.Hardswish, "mish": nn.Mish, "elu": nn.ELU}


def _norm(c=12, groups=3, affine=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    norm = nn.GroupNorm(groups, c, affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.3)
            norm.bias.normal_(0.0, 0.3)
    return norm


def _pair(norm, act):
    return (lambda x: act(norm(x))), FusedGroupNormAct.from_modules(norm, act)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(2, 12, 5, 7), (3, 12, 17), (1, 12, 1, 1)])
def test_matches_eager_forward_and_every_gradient(act, affine, shape):
    norm = _norm(affine=affine, dtype=torch.float64)
    eager, fused = _pair(norm, ACTS[act]())
    x = seeded(*shape, seed=1, dtype=torch.float64, scale=2.0).requires_grad_(True)
    params = list(norm.parameters())
    (out, grads), (ref, ref_grads) = (run_fwd_bwd(f, [x], params) for f in (fused, eager))
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("layout", ["channels_last", "non_contiguous"])
def test_other_layouts(layout):
    norm = _norm(dtype=torch.float64)
    eager, fused = _pair(norm, nn.SiLU())
    x = seeded(2, 12, 6, 5, seed=2, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else non_contiguous(x)
    x.requires_grad_(True)
    (out, grads), (ref, ref_grads) = (run_fwd_bwd(f, [x], list(norm.parameters())) for f in (fused, eager))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_eager_error(dtype):
    norm64 = _norm(c=16, groups=4, dtype=torch.float64)
    norm = _norm(c=16, groups=4, dtype=dtype)
    norm.load_state_dict({k: v.to(dtype) for k, v in norm64.state_dict().items()})
    x64 = seeded(2, 16, 8, 8, seed=3, dtype=torch.float64, scale=2.0).requires_grad_(True)
    x = x64.detach().to(dtype).requires_grad_(True)
    ref, ref_grads = run_fwd_bwd(lambda t: nn.SiLU()(norm64(t)), [x64], list(norm64.parameters()))
    eager, eager_grads = run_fwd_bwd(lambda t: nn.SiLU()(norm(t)), [x], list(norm.parameters()))
    out, grads = run_fwd_bwd(FusedGroupNormAct.from_modules(norm, nn.SiLU()), [x], list(norm.parameters()))
    assert out.dtype == dtype
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_saves_x_and_the_statistics_only():
    norm = _norm()
    eager, fused = _pair(norm, nn.SiLU())
    x = seeded(4, 12, 8, 8, seed=4, requires_grad=True)
    exclude = tuple(norm.parameters())
    got, want = (activation_bytes(lambda f=f: f(x).sum(), exclude=exclude) for f in (fused, eager))
    stats = 2 * 4 * 3 * 4  # mean and 1/std per (sample, group), fp32
    assert got == x.nbytes + stats
    assert want == 2 * x.nbytes + stats  # eager keeps the normalised tensor for the activation


def test_autocast_on_cpu_computes_what_eager_does_and_empty_batches_pass():
    norm = _norm()
    eager, fused = _pair(norm, nn.SiLU())
    x = seeded(2, 12, 4, 4, seed=5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager(x), fused(x)
    assert got.dtype == want.dtype  # CPU autocast runs group_norm in the input's dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    empty = torch.empty(0, 12, 3, 3, requires_grad=True)
    out = fused(empty)
    out.sum().backward()
    assert out.shape == empty.shape and empty.grad.shape == empty.shape


def test_state_dict_pickling_and_bad_arguments():
    norm = _norm()
    fused = FusedGroupNormAct.from_modules(norm, nn.SiLU())
    assert list(fused.state_dict()) == ["norm.weight", "norm.bias"]
    assert "groups=3, channels=12" in repr(fused) and "'silu'" in repr(fused)
    x = seeded(2, 12, 3, 3)
    torch.testing.assert_close(pickle.loads(pickle.dumps(fused))(x), fused(x))
    assert FusedGroupNormAct.supports(nn.LayerNorm(12), nn.SiLU()) == (False,
                                                                      "norm must be nn.GroupNorm, got LayerNorm")
    ok, why = FusedGroupNormAct.supports(norm, nn.Tanh())
    assert not ok and why.startswith("act must be one of")
    with pytest.raises(TypeError, match="norm"):
        FusedGroupNormAct.from_modules(nn.BatchNorm2d(12), nn.SiLU())
    with pytest.raises(TypeError, match="act"):
        FusedGroupNormAct.from_modules(norm, nn.Tanh())
    with pytest.raises(ValueError, match=r"x must be \(N, 12, \*\)"):
        fused(seeded(2, 8, 3, 3))
    with pytest.raises(TypeError, match="x"):
        fused(torch.zeros(2, 12, 3, 3, dtype=torch.int64))
