
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import FusedLinearGELUDropout, FusedLinearGELUDropoutLinear
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, non_contiguous, run_fwd_bwd, seeded


def _modules(k=16, hidden=40, out=12, p=0.3, approximate="none", dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    fc1 = nn.Linear(k, hidden, bias=bias).to(dtype)
    fc2 = nn.Linear(hidden, out, bias=bias).to(dtype)
    return fc1, nn.GELU(approximate=approximate), nn.Dropout(p), fc2


def _fused(chain, mods, **kw):
    fc1, gelu, drop, fc2 = mods
    if chain == "mlp":
        return FusedLinearGELUDropoutLinear.from_modules(fc1, gelu, drop, fc2, seed=11, **kw)
    return FusedLinearGELUDropout.from_modules(fc1, gelu, drop, seed=11, **kw)


def _eager_with_mask(chain, mods, step):
    """The unfused modules with nn.Dropout's mask replaced by the counter-based one of (seed 11, step)."""
    fc1, gelu, drop, fc2 = mods

    def fn(x):
        h = gelu(fc1(x))
        if drop.training and drop.p > 0:
            keep = rng.dropout_mask(11, step * rng.MAX_NUMEL, h.shape, drop.p, h.device)
            h = h * keep * (0.0 if drop.p == 1 else 1.0 / (1 - drop.p))
        return fc2(h) if chain == "mlp" else h
    return fn


def _params(chain, mods):
    fc1, _, _, fc2 = mods
    ps = [fc1.weight, fc1.bias] + ([fc2.weight, fc2.bias] if chain == "mlp" else [])
    return [p for p in ps if p is not None]


CHAINS = ["mlp", "single"]


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("p, approximate", [(0.0, "none"), (0.3, "none"), (0.3, "tanh"), (1.0, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_every_gradient_match_eager(chain, recompute, p, approximate, dtype):
    mods = _modules(p=p, approximate=approximate, dtype=dtype)
    fused = _fused(chain, mods, recompute=recompute)
    fused.set_rng(11, 3)
    x = seeded(3, 5, 16, seed=1, dtype=dtype, requires_grad=True)
    out, grads = run_fwd_bwd(fused, [x], _params(chain, mods))
    ref, ref_grads = run_fwd_bwd(_eager_with_mask(chain, mods, 3), [x], _params(chain, mods))
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")
    assert fused.rng_step == 4


@pytest.mark.parametrize("chain", CHAINS)
def test_p0_is_exactly_the_unfused_modules(chain):
    mods = _modules(p=0.0)
    fc1, gelu, drop, fc2 = mods
    eager = nn.Sequential(fc1, gelu, drop, fc2) if chain == "mlp" else nn.Sequential(fc1, gelu)
    x = seeded(7, 16, seed=2, requires_grad=True)
    out, grads = run_fwd_bwd(_fused(chain, mods), [x], _params(chain, mods))
    ref, ref_grads = run_fwd_bwd(eager, [x], _params(chain, mods))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("chain", CHAINS)
def test_eval_mode_is_deterministic_and_matches_eager(chain):
    mods = _modules(p=0.5)
    fc1, gelu, drop, fc2 = mods
    eager = (nn.Sequential(fc1, gelu, drop, fc2) if chain == "mlp" else nn.Sequential(fc1, gelu, drop)).eval()
    fused = _fused(chain, mods).eval()
    x = seeded(4, 16, seed=3)
    assert_close_dtype(fused(x), eager(x))
    assert fused.rng_step == 0  # eval neither draws nor advances


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_eager_error(chain, dtype):
    mods64 = _modules(p=0.25, dtype=torch.float64)
    mods = _modules(p=0.25, dtype=dtype)
    x64 = seeded(2, 3, 16, seed=4, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    ref, ref_grads = run_fwd_bwd(_eager_with_mask(chain, mods64, 0), [x64], _params(chain, mods64))
    eager, eager_grads = run_fwd_bwd(_eager_with_mask(chain, mods, 0), [x], _params(chain, mods))
    fused = _fused(chain, mods)
    out, grads = run_fwd_bwd(fused, [x], _params(chain, mods))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


@pytest.mark.parametrize("chain", CHAINS)
def test_odd_shapes_non_contiguous_and_no_bias(chain):
    mods = _modules(k=17, hidden=33, out=7, p=0.2, bias=False)
    fused = _fused(chain, mods)
    x = non_contiguous(seeded(5, 17, seed=5)).requires_grad_(True)
    out, grads = run_fwd_bwd(fused, [x], _params(chain, mods))
    ref, ref_grads = run_fwd_bwd(_eager_with_mask(chain, mods, 0), [x], _params(chain, mods))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.parametrize("chain", CHAINS)
def test_empty_batch(chain):
    mods = _modules(p=0.2)
    x = torch.zeros(0, 16, requires_grad=True)
    out, grads = run_fwd_bwd(_fused(chain, mods), [x], _params(chain, mods))
    assert out.shape == (0, 12 if chain == "mlp" else 40)
    assert all(g is None or not g.any() for g in grads)


def test_masks_advance_per_call_and_replay_with_set_rng():
    fused = _fused("single", _modules(p=0.5))
    x = seeded(6, 16, seed=6)
    a, b = fused(x), fused(x)
    assert not torch.equal(a != 0, b != 0)
    fused.set_rng(11, 0)
    assert torch.equal(fused(x), a)
    with pytest.raises(ValueError, match="step"):
        fused.set_rng(1, -1)


def test_from_modules_shares_parameters_and_keys():
    fc1, gelu, drop, fc2 = _modules()
    single = FusedLinearGELUDropout.from_modules(fc1, gelu, drop)
    assert single.weight is fc1.weight and single.bias is fc1.bias
    assert list(single.state_dict()) == ["weight", "bias"]
    mlp = FusedLinearGELUDropoutLinear.from_modules(fc1, gelu, drop, fc2)
    assert mlp.linear2 is fc2 and list(mlp.state_dict()) == ["weight", "bias", "linear2.weight", "linear2.bias"]
    ref = FusedLinearGELUDropoutLinear.from_modules(fc1, gelu, drop, fc2, register_second=False)
    assert list(ref.state_dict()) == ["weight", "bias"] and ref.weight2 is fc2.weight and ref.bias2 is fc2.bias
    with torch.no_grad():  # an optimizer step on the originals is seen by the fused module
        fc2.weight.add_(1.0)
    x = seeded(2, 16, seed=7)
    assert_close_dtype(ref.eval()(x), fc2(gelu(fc1(x))))


@pytest.mark.parametrize("chain", CHAINS)
def test_saves_only_x_and_preactivation(chain):
    mods = _modules(k=32, hidden=64, out=32, p=0.1)
    x = seeded(8, 32, seed=8, requires_grad=True)
    fc1, gelu, drop, fc2 = mods
    eager = nn.Sequential(fc1, gelu, drop, fc2) if chain == "mlp" else nn.Sequential(fc1, gelu, drop)
    h_bytes = 8 * 64 * 4
    assert activation_bytes(lambda: _fused(chain, mods)(x)) == x.nbytes + h_bytes
    assert activation_bytes(lambda: _fused(chain, mods, recompute=True)(x)) == x.nbytes
    eager_bytes = activation_bytes(lambda: eager(x))
    # eager: x, h, a dropout mask/noise and (mlp) the dropout output
    assert eager_bytes >= x.nbytes + h_bytes * (2 if chain == "mlp" else 1) + 8 * 64


def test_bad_arguments_name_the_argument():
    fc1, gelu, drop, fc2 = _modules()
    fused = FusedLinearGELUDropoutLinear.from_modules(fc1, gelu, drop, fc2)
    with pytest.raises(ValueError, match="x"):
        fused(torch.zeros(3, 15))
    with pytest.raises(TypeError, match="x"):
        fused(torch.zeros(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="x"):
        fused([1.0] * 16)
    with pytest.raises(TypeError, match="linear1"):
        FusedLinearGELUDropoutLinear.from_modules(gelu, gelu, drop, fc2)
    with pytest.raises(TypeError, match="gelu"):
        FusedLinearGELUDropout.from_modules(fc1, nn.ReLU(), drop)
    with pytest.raises(TypeError, match="dropout"):
        FusedLinearGELUDropout.from_modules(fc1, gelu, nn.ReLU())
    with pytest.raises(ValueError, match="linear2"):
        FusedLinearGELUDropoutLinear.from_modules(fc1, gelu, drop, nn.Linear(41, 3))
    with pytest.raises(ValueError, match="p"):
        FusedLinearGELUDropout(fc1.weight, fc1.bias, p=1.5)
    with pytest.raises(ValueError, match="approximate"):
        FusedLinearGELUDropout(fc1.weight, fc1.bias, approximate="fast")
    with pytest.raises(ValueError, match="seed"):
        FusedLinearGELUDropout(fc1.weight, fc1.bias, seed=-3)


# --------------------------------------------------------------------------- Triton paths
@pytest.mark.parametrize("chain, recompute", [("mlp", False), ("single", True)])
def test_triton_interpreter_matches_eager(interpreted, chain, recompute):
    mods = _modules(k=8, hidden=20, out=6, p=0.3)
    x = seeded(2, 3, 8, seed=9, requires_grad=True)
    out, grads = run_fwd_bwd(_fused(chain, mods, recompute=recompute), [x], _params(chain, mods))
    ref, ref_grads = run_fwd_bwd(_eager_with_mask(chain, mods, 0), [x], _params(chain, mods))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_matches_eager_error_bound(chain, dtype):
    mods = [m.cuda() for m in _modules(k=768, hidden=3072, out=768, p=0.1, dtype=dtype)]
    mods64 = [m.cuda() for m in _modules(k=768, hidden=3072, out=768, p=0.1, dtype=torch.float64)]
    x64 = seeded(1151, 768, seed=10, dtype=torch.float64, device="cuda", requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    out, grads = run_fwd_bwd(_fused(chain, mods), [x], _params(chain, mods))
    eager, eager_grads = run_fwd_bwd(_eager_with_mask(chain, mods, 0), [x], _params(chain, mods))
    ref, ref_grads = run_fwd_bwd(_eager_with_mask(chain, mods64, 0), [x64], _params(chain, mods64))
    if dtype == torch.float32:
        torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_eager_reference_uses_plain_gelu():
    # guards the oracle itself: with p = 0 it must be the plain unfused computation
    mods = _modules(p=0.0)
    x = seeded(3, 16, seed=11)
    assert_close_dtype(_eager_with_mask("single", mods, 0)(x), F.gelu(mods[0](x)))
