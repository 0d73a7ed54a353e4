
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import rng
from opsnn_lab.ops import (
    FusedLinearActDropout,
    FusedLinearActDropoutLinear,
    FusedLinearGELUDropout,
    FusedLinearGELUDropoutLinear,
)
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
def test_eval_mode_with_grad_runs_the_fused_op_without_a_draw(chain):
    """Eval with grad (a Dropout switched off in a training model, which ``ol.fusion`` runs the op in): the fused
    op without dropout, so it keeps its bytes, instead of the plain ops; no draw, eager's values and gradients."""
    mods = _modules(p=0.5)
    fc1, gelu, drop, fc2 = mods
    eager = (nn.Sequential(fc1, gelu, drop, fc2) if chain == "mlp" else nn.Sequential(fc1, gelu, drop)).eval()
    fused = _fused(chain, mods).eval()
    x = seeded(4, 16, seed=3, requires_grad=True)
    out, grads = run_fwd_bwd(fused, [x], _params(chain, mods))
    ref, ref_grads = run_fwd_bwd(eager, [x], _params(chain, mods))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)
    assert fused.rng_step == 0
    fused_bytes, eager_bytes = activation_bytes(lambda: fused(x)), activation_bytes(lambda: eager(x))
    assert fused_bytes < eager_bytes if chain == "mlp" else fused_bytes == eager_bytes  # alone: x and the GEMM's out


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


# --------------------------------------------------------------------------- every activation, nn.Linear and HF Conv1D
class Conv1D(nn.Module):  # stand-in for transformers.pytorch_utils.Conv1D: weight [in, out], y = x @ W + b
    def __init__(self, nf, nx, bias=True):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1) if bias else None

    def forward(self, x):
        y = x.reshape(-1, x.shape[-1]) @ self.weight
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.nf)


class NewGELUActivation(nn.Module):  # GPT-2's gelu_new, as Hugging Face writes it
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


class QuickGELUActivation(nn.Module):  # CLIP
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


ACT_MODULES = {"gelu": nn.GELU, "gelu_tanh": NewGELUActivation, "quick_gelu": QuickGELUActivation,
               "silu": nn.SiLU, "relu": nn.ReLU}


def _layers(kind, k=16, hidden=40, out=12, dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    if kind == "conv1d":
        return Conv1D(hidden, k, bias).to(dtype), Conv1D(out, hidden, bias).to(dtype)
    return nn.Linear(k, hidden, bias=bias).to(dtype), nn.Linear(hidden, out, bias=bias).to(dtype)


def _act_eager(l1, act, p, l2, step=0):
    def fn(x):
        h = act(l1(x))
        if p > 0:
            h = h * rng.dropout_mask(11, step * rng.MAX_NUMEL, h.shape, p, h.device) * (0.0 if p == 1 else 1 / (1 - p))
        return h if l2 is None else l2(h)
    return fn


def _act_fused(l1, act, p, l2, **kw):
    if l2 is None:
        return FusedLinearActDropout.from_modules(l1, act, nn.Dropout(p), seed=11, **kw)
    return FusedLinearActDropoutLinear.from_modules(l1, act, nn.Dropout(p), l2, seed=11, **kw)


def _all_params(*layers):
    return [t for m in layers if m is not None for t in (m.weight, m.bias) if t is not None]


@pytest.mark.parametrize("act", list(ACT_MODULES))
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("second", [False, True])
@pytest.mark.parametrize("p, recompute", [(0.0, False), (0.3, True), (0.3, False)])
def test_every_activation_and_layout_match_eager(act, kind, second, p, recompute):
    l1, l2 = _layers(kind)
    l2 = l2 if second else None
    fused = _act_fused(l1, ACT_MODULES[act](), p, l2, recompute=recompute)
    assert fused.act == act and fused.transposed == (kind == "conv1d")
    x = seeded(3, 5, 16, seed=12, requires_grad=True)
    out, grads = run_fwd_bwd(fused, [x], _all_params(l1, l2))
    ref, ref_grads = run_fwd_bwd(_act_eager(l1, ACT_MODULES[act](), p, l2), [x], _all_params(l1, l2))
    assert_close_dtype(out, ref)
    assert len(grads) == len(ref_grads) == 1 + 2 * (1 + second)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("act", ["gelu_tanh", "quick_gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_activation_low_precision_within_twice_eager_error(act, dtype):
    (l1, l2), (m1, m2) = _layers("conv1d", dtype=torch.float64), _layers("conv1d", dtype=dtype)
    x64 = seeded(4, 7, 16, seed=13, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    ref, ref_grads = run_fwd_bwd(_act_eager(l1, ACT_MODULES[act](), 0.2, l2), [x64], _all_params(l1, l2))
    eager, eager_grads = run_fwd_bwd(_act_eager(m1, ACT_MODULES[act](), 0.2, m2), [x], _all_params(m1, m2))
    out, grads = run_fwd_bwd(_act_fused(m1, ACT_MODULES[act](), 0.2, m2), [x], _all_params(m1, m2))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_conv1d_equals_linear_with_the_transposed_weight():
    c1, c2 = _layers("conv1d", k=17, hidden=33, out=7)
    l1, l2 = nn.Linear(17, 33), nn.Linear(33, 7)
    with torch.no_grad():
        for c, lin in ((c1, l1), (c2, l2)):
            lin.weight.copy_(c.weight.t())
            lin.bias.copy_(c.bias)
    x = non_contiguous(seeded(1823, 17, seed=14)).requires_grad_(True)
    out_c, grads_c = run_fwd_bwd(_act_fused(c1, nn.SiLU(), 0.1, c2), [x], _all_params(c1, c2))
    out_l, grads_l = run_fwd_bwd(_act_fused(l1, nn.SiLU(), 0.1, l2), [x], _all_params(l1, l2))
    # the same sums with the weight stored the other way round: the GEMMs may round differently (on an
    # AVX2 CPU under ATEN_CPU_CAPABILITY=default, one weight-gradient element of 231 by 4e-5 relative), so
    # both are judged against the Linear path in float64: Conv1D within 2x the Linear path's own error
    l1_64, l2_64 = copy.deepcopy(l1).double(), copy.deepcopy(l2).double()
    x64 = x.detach().double().requires_grad_(True)
    out_64, grads_64 = run_fwd_bwd(_act_fused(l1_64, nn.SiLU(), 0.1, l2_64), [x64], _all_params(l1_64, l2_64))
    assert_within_eager_error(out_c, out_l, out_64)
    for g_c, g_l, g_64, name in zip(grads_c, grads_l, grads_64, ["x", "w1", "b1", "w2", "b2"]):
        flip = (lambda g: g.t()) if g_l.dim() == 2 and g_l.shape != g_c.shape else (lambda g: g)
        assert_within_eager_error(g_c, flip(g_l), flip(g_64), name=name)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_every_activation_eval_empty_and_saved_bytes(kind):
    l1, l2 = _layers(kind)
    fused = _act_fused(l1, QuickGELUActivation(), 0.5, l2).eval()
    x = seeded(4, 16, seed=15, requires_grad=True)
    assert_close_dtype(fused(x), _act_eager(l1, QuickGELUActivation(), 0.0, l2)(x))
    assert fused.rng_step == 0
    out, grads = run_fwd_bwd(_act_fused(l1, nn.ReLU(), 0.2, l2), [torch.zeros(0, 16, requires_grad=True)],
                             _all_params(l1, l2))
    assert out.shape == (0, 12) and all(g is None or not g.any() for g in grads)
    assert activation_bytes(lambda: _act_fused(l1, nn.SiLU(), 0.1, l2).train()(x)) == x.nbytes + 4 * 40 * 4


def test_act_ops_supports_and_bad_arguments():
    l1, l2 = _layers("conv1d")
    assert FusedLinearActDropoutLinear.supports(l1, NewGELUActivation(), nn.Dropout(0.1), l2) == (True, "")
    cases = [((nn.Conv1d(16, 40, 1), nn.SiLU(), None, l2), TypeError, "linear1"),
             ((l1, nn.Tanh(), None, l2), TypeError, "act"),
             ((l1, nn.SiLU(), nn.ReLU(), l2), TypeError, "dropout"),
             ((l1, nn.SiLU(), None, Conv1D(3, 41)), ValueError, "linear2")]
    for args, exc, word in cases:
        ok, why = FusedLinearActDropoutLinear.supports(*args)
        assert not ok and word in why, why
        with pytest.raises(exc, match=word):
            FusedLinearActDropoutLinear.from_modules(*args)
    assert FusedLinearActDropout.supports(l1, nn.Hardswish())[1].startswith("act:")
    assert "GELU only" in FusedLinearGELUDropout.supports(l1, nn.SiLU())[1]
    assert FusedLinearGELUDropout.from_modules(l1, NewGELUActivation()).approximate == "tanh"
    with pytest.raises(ValueError, match="act"):
        FusedLinearActDropout(l1.weight, l1.bias, act="swish")
    with pytest.raises(ValueError, match="x"):
        FusedLinearActDropout.from_modules(l1, nn.SiLU())(torch.zeros(2, 40))


def test_act_triton_interpreter_matches_eager(interpreted):
    l1, l2 = _layers("conv1d", k=8, hidden=20, out=6)
    x = seeded(2, 3, 8, seed=16, requires_grad=True)
    out, grads = run_fwd_bwd(_act_fused(l1, QuickGELUActivation(), 0.3, l2), [x], _all_params(l1, l2))
    ref, ref_grads = run_fwd_bwd(_act_eager(l1, QuickGELUActivation(), 0.3, l2), [x], _all_params(l1, l2))
    assert_close_dtype(out, ref)
    for g, r in zip(grads, ref_grads):
        assert_close_dtype(g, r)


@pytest.mark.slow  # importing transformers takes 10-25 s on the CI machine
def test_gpt2_and_clip_mlps_fuse_and_match():
    pytest.importorskip("transformers")
    from transformers import CLIPTextConfig, GPT2Config
    from transformers.models.clip.modeling_clip import CLIPMLP
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    gpt2 = GPT2MLP(64, GPT2Config(n_embd=16, activation_function="gelu_new", resid_pdrop=0.0))
    fused = FusedLinearActDropoutLinear.from_modules(gpt2.c_fc, gpt2.act, None, gpt2.c_proj)
    clip = CLIPMLP(CLIPTextConfig(hidden_size=16, intermediate_size=64, hidden_act="quick_gelu"))
    fused_clip = FusedLinearActDropoutLinear.from_modules(clip.fc1, clip.activation_fn, None, clip.fc2)
    assert (fused.act, fused.transposed, fused_clip.act) == ("gelu_tanh", True, "quick_gelu")
    x = seeded(2, 5, 16, seed=17, requires_grad=True)
    for f, eager, layers in ((fused, gpt2, (gpt2.c_fc, gpt2.c_proj)), (fused_clip, clip, (clip.fc1, clip.fc2))):
        out, grads = run_fwd_bwd(f, [x], _all_params(*layers))
        ref, ref_grads = run_fwd_bwd(eager, [x], _all_params(*layers))
        assert_close_dtype(out, ref)
        for g, r in zip(grads, ref_grads):
            assert_close_dtype(g, r)
