"""GroupNorm / InstanceNorm -> PReLU (MONAI's UNet default): the fused norm ops take an ``nn.PReLU`` of one slope or
one per channel, whose weight gets its gradient; against eager in fp64 (every gradient), in bf16 / fp16 within twice
eager's error, under CPU autocast (PReLU in autocast's dtype, as eager); what they save; state_dict; the reasons."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opsnn_lab.measuring import activation_bytes
from opsnn_lab.ops import FusedGroupNormAct, FusedInstanceNormAct
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, run_fwd_bwd, seeded

NORMS = {"group": (FusedGroupNormAct, lambda c: nn.GroupNorm(2, c)),
         "instance": (FusedInstanceNormAct, lambda c: nn.InstanceNorm3d(c, affine=True))}
SHAPE = (2, 6, 3, 5, 4)


def _modules(kind, slopes, dtype, seed=0):
    torch.manual_seed(seed)
    norm, prelu = NORMS[kind][1](6).to(dtype), nn.PReLU(slopes).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
        prelu.weight.uniform_(0.05, 0.5)
    return norm, prelu


def _both(kind, slopes, dtype):
    norm, prelu = _modules(kind, slopes, dtype)
    twin, twin_prelu = copy.deepcopy(norm), copy.deepcopy(prelu)
    fused = NORMS[kind][0].from_modules(norm, prelu)
    return fused, [*norm.parameters(), prelu.weight], (lambda x: twin_prelu(twin(x))), [*twin.parameters(),
                                                                                         twin_prelu.weight]


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("slopes", [1, 6])
def test_matches_eager_forward_and_every_gradient(kind, slopes):
    fused, params, eager, eager_params = _both(kind, slopes, torch.float64)
    x = seeded(*SHAPE, seed=1, dtype=torch.float64, scale=2.0).requires_grad_(True)
    (out, grads), (ref, ref_grads) = run_fwd_bwd(fused, [x], params), run_fwd_bwd(eager, [x], eager_params)
    assert_close_dtype(out, ref)
    assert grads[-1].shape == (slopes,)  # the PReLU's own gradient
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_eager_error(kind, dtype):
    fused, params, eager, eager_params = _both(kind, 6, dtype)
    ref, ref_params = (copy.deepcopy(m).double() for m in _modules(kind, 6, dtype))
    x64 = seeded(*SHAPE, seed=2, dtype=torch.float64, scale=2.0).to(dtype).double().requires_grad_(True)
    want, want_grads = run_fwd_bwd(lambda t: ref_params(ref(t)), [x64], [*ref.parameters(), ref_params.weight])
    x = x64.detach().to(dtype).requires_grad_(True)
    (out, grads), (e_out, e_grads) = run_fwd_bwd(fused, [x], params), run_fwd_bwd(eager, [x], eager_params)
    assert_within_eager_error(out, e_out, want)
    for i, (g, e, r) in enumerate(zip(grads, e_grads, want_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


@pytest.mark.parametrize("kind", list(NORMS))
def test_cpu_autocast_runs_the_prelu_in_its_dtype_as_eager(kind):
    fused, params, eager, eager_params = _both(kind, 6, torch.float32)
    x = seeded(*SHAPE, seed=3, scale=2.0).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out, grads), (ref, ref_grads) = run_fwd_bwd(fused, [x], params), run_fwd_bwd(eager, [x], eager_params)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):  # fp32 leaves; eager rounds through bf16 on the way
        assert g.dtype == r.dtype == torch.float32
        assert_close_dtype(g, r, dtype=torch.bfloat16, msg=f"grad {i}")


@pytest.mark.parametrize("kind", list(NORMS))
def test_saves_x_and_the_statistics_only(kind):
    fused, params, eager, eager_params = _both(kind, 6, torch.float32)
    x = seeded(*SHAPE, seed=4, requires_grad=True)
    got = activation_bytes(lambda: fused(x).sum(), exclude=tuple(params))
    want = activation_bytes(lambda: eager(x).sum(), exclude=tuple(eager_params))
    assert got <= x.nbytes + 2 * 2 * 6 * 4 and want >= 2 * x.nbytes  # eager keeps the PReLU's input too


def test_state_dict_reasons_and_bad_inputs():
    norm, prelu = _modules("instance", 6, torch.float32)
    fused = FusedInstanceNormAct.from_modules(norm, prelu)
    assert list(fused.state_dict()) == ["norm.weight", "norm.bias", "prelu.weight"]
    assert "act='prelu'" in repr(fused)
    assert FusedGroupNormAct.supports(nn.GroupNorm(2, 6), nn.PReLU(4)) == (
        False, "act (PReLU) has 4 parameters for 6 channels")

    class Shifted(nn.PReLU):
        def forward(self, x):
            return super().forward(x) + 1

    ok, why = FusedGroupNormAct.supports(nn.GroupNorm(2, 6), Shifted())
    assert not ok and "Shifted" in why
    free = FusedInstanceNormAct.from_modules(nn.InstanceNorm2d(6), nn.PReLU(6))  # no affine: channels checked per call
    with pytest.raises(ValueError, match=r"act \(PReLU\) has 6 parameters, x has 4 channels"):
        free(seeded(2, 4, 3, 3))
    with pytest.raises(TypeError, match=r"act \(PReLU\) weight is torch.float64"):
        FusedGroupNormAct.from_modules(nn.GroupNorm(2, 6), nn.PReLU(6).double())(seeded(2, 6, 3, 3))
