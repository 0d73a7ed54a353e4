"""Fused ops under ``torch.autocast``: the dtypes eager autocast gives, its accuracy, gradients to fp32 parameters.

Each case builds eager modules and the fused op over the same Parameters. Eager under autocast is the baseline:
the fused output and every gradient have its dtypes, and their error against an fp64 run of the eager modules
is within twice eager-autocast's own error (the low-precision criterion of ``opsnn_lab.testing``).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.ops import _amp
from opsnn_lab.testing import assert_within_eager_error, seeded

AMP = torch.bfloat16


class _Chain(nn.Module):
    def __init__(self, *mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


class _Gated(nn.Module):
    def __init__(self, h=24, inter=40, bias=False):
        super().__init__()
        self.gate, self.up = nn.Linear(h, inter, bias=bias), nn.Linear(h, inter, bias=bias)
        self.down = nn.Linear(inter, h, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Packed(nn.Module):
    def __init__(self, h=24, inter=40):
        super().__init__()
        self.gate_up, self.down = nn.Linear(h, 2 * inter), nn.Linear(inter, h)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


class _QKV(nn.Module):
    def __init__(self, h=24):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, 8), nn.Linear(h, 8)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)


def _mlp():
    eager = _Chain(nn.Linear(24, 40), nn.GELU(approximate="tanh"), nn.Dropout(0.0), nn.Linear(40, 24))
    return eager, ol.ops.FusedLinearActDropoutLinear.from_modules(*eager.mods), (3, 7, 24)


def _linear_act():
    eager = _Chain(nn.Linear(24, 40), nn.SiLU())
    return eager, ol.ops.FusedLinearActDropout.from_modules(*eager.mods), (5, 24)


def _gated():
    eager = _Gated()
    return eager, ol.ops.FusedGatedMLP.from_modules(eager.gate, eager.up, eager.down, nn.SiLU()), (2, 9, 24)


def _packed():
    eager = _Packed()
    return eager, ol.ops.FusedPackedGatedMLP.from_packed(eager.gate_up, eager.down, nn.SiLU()), (2, 9, 24)


def _qkv():
    eager = _QKV()

    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = ol.ops.FusedQKV.from_modules(eager.q, eager.k, eager.v, pack=False)

        def forward(self, x):
            return torch.cat(self.op(x), -1)
    return eager, Cat(), (2, 9, 24)


def _conv(act, groups=1):
    def build():
        c = 16
        eager = _Chain(nn.Conv2d(c, c, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(c), act())
        return eager, ol.ops.FusedConvBNAct.from_modules(*eager.mods), (2, c, 7, 7)
    return build


def _layer_norm():
    eager = _Chain(nn.LayerNorm(24))
    with torch.no_grad():
        eager.mods[0].weight.uniform_(0.5, 1.5)
    return eager, ol.ops.FusedLayerNorm.from_modules(eager.mods[0]), (4, 6, 24)


def _rms_norm():
    eager = _Chain(nn.RMSNorm(24, eps=1e-6))
    return eager, ol.ops.FusedRMSNorm.from_modules(eager.mods[0]), (4, 6, 24)


CASES = {"linear_gelu_tanh_dropout_linear": _mlp, "linear_silu": _linear_act, "gated_mlp_silu": _gated,
         "gated_mlp_silu[packed]": _packed, "qkv": _qkv, "conv_bn_relu6": _conv(nn.ReLU6),
         "conv_bn_silu_dw": _conv(nn.SiLU, groups=16), "layer_norm": _layer_norm, "rms_norm": _rms_norm}


def _run(module, x, params, *, autocast=True, backward_inside=False):
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    with torch.autocast("cpu", dtype=AMP, enabled=autocast):
        out = module(x)
    with torch.autocast("cpu", dtype=AMP, enabled=backward_inside):
        if backward_inside:
            out.backward(seeded(*out.shape, seed=7, dtype=out.dtype))
    if not backward_inside:
        out.backward(seeded(*out.shape, seed=7, dtype=out.dtype))
    return out.detach(), [x.grad] + [p.grad.clone() for p in params]


def _check_like_eager_autocast(case):
    """Output and every gradient of the fused op: eager autocast's dtypes, within 2x its error against fp64."""
    torch.manual_seed(0)
    eager, fused, shape = CASES[case]()
    params = list(eager.parameters())
    x = seeded(*shape, seed=1)
    ref_out, ref_grads = _run(eager, x, params)
    out, grads = _run(fused, x, params)
    assert out.dtype == ref_out.dtype  # bf16 after a matmul, fp32 out of a norm of an fp32 input
    double = copy.deepcopy(eager).double()
    out64, grads64 = _run(double, x.double(), list(double.parameters()), autocast=False)
    assert_within_eager_error(out, ref_out, out64, name=f"{case} output")
    for i, (g, r, g64) in enumerate(zip(grads, ref_grads, grads64)):
        assert g.dtype == r.dtype == torch.float32  # the casts carry gradients back to fp32
        # the gradients went through bf16 GEMMs: judge them at bf16's ulp
        floor = torch.finfo(AMP).eps * g64.abs().max().item()
        assert_within_eager_error(g, r, g64, floor=floor, name=f"{case} grad {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_fused_op_under_autocast_matches_eager_autocast(case):
    _check_like_eager_autocast(case)


@pytest.mark.parametrize("forward_autocast", [True, False], ids=["bf16_forward", "fp32_forward"])
@pytest.mark.parametrize("case", ["linear_gelu_tanh_dropout_linear", "gated_mlp_silu", "qkv", "conv_bn_relu6",
                                  "rms_norm"])
def test_backward_inside_an_autocast_region_gives_the_same_gradients(case, forward_autocast):
    """``loss.backward()`` inside ``with torch.autocast(...)``: the ops' backward GEMMs stay in the forward's dtype
    (autocast would cast an fp32 one to bf16)."""
    torch.manual_seed(0)
    eager, fused, shape = CASES[case]()
    params = list(eager.parameters())
    x = seeded(*shape, seed=1)
    out, grads = _run(fused, x, params, autocast=forward_autocast)
    out_in, grads_in = _run(fused, x, params, autocast=forward_autocast, backward_inside=True)
    torch.testing.assert_close(out_in, out, atol=0, rtol=0)
    for g, g_in in zip(grads, grads_in):
        torch.testing.assert_close(g_in, g, atol=0, rtol=0)


def test_eval_mode_under_autocast_takes_the_plain_path_in_autocast_dtype():
    torch.manual_seed(0)
    eager, fused, shape = _mlp()
    eager.eval(), fused.eval()
    x = seeded(*shape, seed=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=AMP):
        a, b = eager(x), fused(x)
    assert a.dtype == b.dtype == AMP
    torch.testing.assert_close(b, a, atol=0, rtol=0)  # the same bf16 GEMMs and activation


def test_add_norm_widens_a_bf16_sublayer_output_onto_an_fp32_residual():
    torch.manual_seed(0)
    norm = nn.LayerNorm(24)
    op = ol.ops.FusedAddLayerNorm.from_modules(norm)
    x, res = seeded(3, 24, seed=1, dtype=AMP), seeded(3, 24, seed=2)
    with torch.autocast("cpu", dtype=AMP):
        y, s = op(x, res)
        s_ref = x + res
        y_ref = norm(s_ref)
    assert s.dtype == y.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="residual must match"):  # outside autocast the contract is one dtype
        op(x, res)


def test_attention_casts_q_k_v_and_a_float_mask_as_sdpa_under_autocast():
    q, k, v = (seeded(2, 2, 5, 8, seed=s) for s in (1, 2, 3))
    mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    with torch.autocast("cpu", dtype=AMP):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = ol.ops.FusedAttention()(q.to(AMP), k, v, mask)  # mixed, as autocast tolerates
        drop = ol.ops.attention.counter_sdpa(q, k, v, mask, 0.5, seed=3)
    assert out.dtype == ref.dtype == drop.dtype == AMP
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    zeros = (drop == 0).float().mean().item()
    assert 0.2 < zeros < 0.8  # dropout ran in the cast dtype


def test_linear_cross_entropy_backward_inside_autocast_keeps_fp32_gemms():
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    h, t = seeded(12, 16, seed=1, requires_grad=True), torch.randint(0, 50, (12,))
    grads = []
    for inside in (False, True):
        loss = ol.ops.linear_cross_entropy(h, head.weight, t, head.bias, recompute=True)
        with torch.autocast("cpu", dtype=AMP, enabled=inside):
            g = torch.autograd.grad(loss, (h, head.weight))
        grads.append(g)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_linear_cross_entropy_under_autocast_is_eager_autocast_loss():
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    h, t = seeded(12, 16, seed=1), torch.randint(0, 50, (12,))
    with torch.autocast("cpu", dtype=AMP):
        ref = F.cross_entropy(head(h), t)
        loss = ol.ops.FusedLinearCrossEntropy.from_modules(head)(h, t)
    assert loss.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=2e-3, rtol=2e-3)
    loss.backward()
    assert head.weight.grad.dtype == torch.float32 and torch.isfinite(head.weight.grad).all()


def test_float64_inputs_are_not_cast_and_autocast_off_leaves_everything_alone():
    x = seeded(4, 8, dtype=torch.float64)
    w = torch.ones(3, 8)
    with torch.autocast("cpu", dtype=AMP):
        with _amp.region(x) as cast:
            assert not torch.is_autocast_enabled("cpu")
            cx, cw, none = cast(x, w, None)
        assert torch.is_autocast_enabled("cpu")
    assert cx.dtype == torch.float64 and cw.dtype == AMP and none is None
    with _amp.region(x) as cast:
        assert cast(x, w)[1] is w
    assert _amp.autocast_dtype(x) is None


def test_bad_input_under_autocast_still_names_the_argument():
    _, fused, _ = _gated()
    with torch.autocast("cpu", dtype=AMP), pytest.raises(ValueError, match="x must have 24 features"):
        fused(torch.randn(3, 5))
    with torch.autocast("cpu", dtype=AMP), pytest.raises(TypeError, match="weight"):
        ol.ops.linear_cross_entropy(torch.randn(3, 4), [1, 2], torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("case", ["conv_bn_relu6", "conv_bn_silu_dw", "layer_norm", "gated_mlp_silu",
                                  "linear_gelu_tanh_dropout_linear"])
def test_the_triton_kernels_take_autocast_operands(case, monkeypatch):
    """The GPU route under autocast (bf16 activations, fp32 BN/norm parameters), in the Triton interpreter."""
    from opsnn_lab.kernels import triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("OPSNN_BACKEND", "triton")  # conftest runs Triton in its interpreter on CPU
    _check_like_eager_autocast(case)
