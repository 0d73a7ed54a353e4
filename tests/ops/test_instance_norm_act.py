"""FusedInstanceNormAct: ``act(InstanceNorm{1,2,3}d(x))`` against eager, every gradient, affine or not, batched or
not, per dtype (fp16/bf16 within twice eager's error against fp64); running statistics as eager keeps them, in
training and eval; channels-last, non-contiguous and empty inputs; what it saves; bad arguments."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from opsnn_lab.measuring import activation_bytes
from opsnn_lab.ops import FusedInstanceNormAct
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, run_fwd_bwd, seeded

NORMS = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
ACTS = {"leaky_relu": lambda: nn.LeakyReLU(0.2), "silu": nn.SiLU, "gelu": nn.GELU, "relu": nn.ReLU,
        "hardswish": nn.Hardswish}


def _norm(dims=2, c=6, affine=True, track=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    norm = NORMS[dims](c, affine=affine, track_running_stats=track).to(dtype)
    with torch.no_grad():
        if affine:
            norm.weight.normal_(1.0, 0.3)
            norm.bias.normal_(0.0, 0.3)
        if track:
            norm.running_mean.normal_(0.0, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
    return norm


def _pair(norm, act):
    """(eager on its own copy of the norm, the fused op on another): buffers are updated by both."""
    twin = copy.deepcopy(norm)
    return (lambda x: act(twin(x))), twin, FusedInstanceNormAct.from_modules(norm, act)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dims, shape", [(1, (2, 6, 17)), (2, (3, 6, 5, 7)), (3, (2, 6, 3, 4, 5)), (2, (6, 5, 7))],
                         ids=["1d", "2d", "3d", "2d-unbatched"])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_eager_forward_and_every_gradient(act, dims, shape, affine):
    norm = _norm(dims, affine=affine, dtype=torch.float64)
    eager, twin, fused = _pair(norm, ACTS[act]())
    x = seeded(*shape, seed=1, dtype=torch.float64, scale=2.0).requires_grad_(True)
    (out, grads), (ref, ref_grads) = (run_fwd_bwd(f, [x], list(n.parameters()))
                                      for f, n in ((fused, norm), (eager, twin)))
    assert out.shape == ref.shape == x.shape
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_follow_eager_in_training_and_eval(momentum):
    norm = _norm(3, track=True, dtype=torch.float64)
    norm.momentum = momentum
    eager, twin, fused = _pair(norm, nn.LeakyReLU(0.01))
    for step in range(3):
        x = seeded(2, 6, 3, 4, 5, seed=10 + step, dtype=torch.float64, scale=3.0) + step
        assert_close_dtype(fused(x), eager(x))
    assert_close_dtype(norm.running_mean, twin.running_mean)
    assert_close_dtype(norm.running_var, twin.running_var)
    assert norm.num_batches_tracked.item() == twin.num_batches_tracked.item() == 0  # InstanceNorm counts none
    if momentum is None:  # nn.InstanceNorm*d passes momentum 0: the buffers stay as they were
        assert not torch.equal(norm.running_mean, torch.zeros_like(norm.running_mean))
    fused.eval(), twin.eval()
    x = seeded(2, 6, 3, 4, 5, seed=20, dtype=torch.float64).requires_grad_(True)
    (out, grads), (ref, ref_grads) = (run_fwd_bwd(f, [x], list(n.parameters()))
                                      for f, n in ((fused, norm), (eager, twin)))
    assert_close_dtype(out, ref)  # eval normalises with the running statistics, as eager does
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("layout", ["channels_last", "non_contiguous"])
def test_other_layouts(layout):
    norm = _norm(dtype=torch.float64)
    eager, twin, fused = _pair(norm, nn.SiLU())
    x = seeded(2, 6, 6, 5, seed=2, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else non_contiguous(x)
    x.requires_grad_(True)
    (out, grads), (ref, ref_grads) = (run_fwd_bwd(f, [x], list(n.parameters()))
                                      for f, n in ((fused, norm), (eager, twin)))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_eager_error(dtype):
    norm64 = _norm(c=8, dtype=torch.float64)
    norm = _norm(c=8, dtype=dtype)
    norm.load_state_dict({k: v.to(dtype) for k, v in norm64.state_dict().items()})
    x64 = seeded(2, 8, 9, 7, seed=3, dtype=torch.float64, scale=2.0).requires_grad_(True)
    x = x64.detach().to(dtype).requires_grad_(True)
    act = nn.LeakyReLU(0.01)
    ref, ref_grads = run_fwd_bwd(lambda t: act(norm64(t)), [x64], list(norm64.parameters()))
    eager, eager_grads = run_fwd_bwd(lambda t: act(norm(t)), [x], list(norm.parameters()))
    out, grads = run_fwd_bwd(FusedInstanceNormAct.from_modules(norm, act), [x], list(norm.parameters()))
    assert out.dtype == dtype
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_saves_x_and_the_statistics_only():
    norm = _norm(c=8)
    eager, twin, fused = _pair(norm, nn.LeakyReLU(0.01))
    x = seeded(4, 8, 8, 8, seed=4, requires_grad=True)
    got, want = (activation_bytes(lambda f=f: f(x).sum(), exclude=tuple(n.parameters()))
                 for f, n in ((fused, norm), (eager, twin)))
    stats = 2 * 4 * 8 * 4  # mean and 1/std per (sample, channel), fp32
    assert got == x.nbytes + stats
    repeated = 4 * 8 * 4  # eager's batch_norm over (1, N * C, *) keeps the weight repeated per sample
    assert want == 2 * x.nbytes + stats + repeated  # and the normalised tensor for the activation


def test_empty_batches_autocast_and_channels_without_affine():
    norm = _norm(c=6, affine=False)
    eager, twin, fused = _pair(norm, nn.SiLU())
    empty = torch.empty(0, 6, 3, 3, requires_grad=True)
    out = fused(empty)
    out.sum().backward()
    assert out.shape == empty.shape and empty.grad.shape == empty.shape
    x = seeded(2, 9, 4, 4, seed=5)  # without affine parameters the channel count is free (eager warns and runs)
    with pytest.warns(UserWarning):
        want = eager(x)
    assert_close_dtype(fused(x), want)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning):
        assert fused(x).dtype == eager(x).dtype == torch.float32  # instance_norm keeps its input's dtype
    tracked = FusedInstanceNormAct.from_modules(_norm(c=6, track=True), nn.SiLU())
    before = tracked.norm.running_mean.clone()
    tracked(torch.empty(0, 6, 3, 3))  # eager's instance_norm turns both buffers to NaN here; the op leaves them
    assert torch.equal(tracked.norm.running_mean, before) and not tracked.norm.running_var.isnan().any()


def test_state_dict_pickling_and_bad_arguments():
    norm = _norm(c=6, track=True)
    fused = FusedInstanceNormAct.from_modules(norm, nn.SiLU())
    assert list(fused.state_dict()) == ["norm.weight", "norm.bias", "norm.running_mean", "norm.running_var",
                                        "norm.num_batches_tracked"]
    assert "InstanceNorm2d, channels=6" in repr(fused) and "'silu'" in repr(fused)
    x = seeded(2, 6, 3, 3)
    torch.testing.assert_close(pickle.loads(pickle.dumps(fused)).eval()(x), fused.eval()(x))
    assert FusedInstanceNormAct.supports(nn.GroupNorm(2, 6), nn.SiLU()) == (
        False, "norm must be nn.InstanceNorm1d, nn.InstanceNorm2d or nn.InstanceNorm3d, got GroupNorm")
    ok, why = FusedInstanceNormAct.supports(norm, nn.Tanh())
    assert not ok and why.startswith("act must be one of")
    with pytest.raises(TypeError, match="norm"):
        FusedInstanceNormAct.from_modules(nn.BatchNorm2d(6), nn.SiLU())
    with pytest.raises(TypeError, match="act"):
        FusedInstanceNormAct.from_modules(norm, nn.Tanh())
    fused.train()
    with pytest.raises(ValueError, match=r"x must be \(6, \*\) or \(N, 6, \*\) with 2 spatial dims"):
        fused(seeded(2, 8, 3, 3))
    with pytest.raises(ValueError, match=r"x must be \(6, \*\) or \(N, 6, \*\)"):
        fused(seeded(2, 6, 3, 3, 3))
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        fused(seeded(2, 6, 1, 1))
    with pytest.raises(TypeError, match="x"):
        fused(torch.zeros(2, 6, 3, 3, dtype=torch.int64))
