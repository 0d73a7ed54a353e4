"""Model classes named by what they compute, probed before the trace.

* nn.Linear subclasses with their own forward: one that computes F.linear (Falcon's ``FalconLinear``,
  ``x @ W.T + b``) runs as one Linear and fuses; any other is looked into, and its parameters never reach a
  fused op as a Linear's.
* Parameter-free modules of unknown class that compute one activation the fused ops take (a hand-written
  gelu_new, Bloom's BloomGelu with its own backward) run as that activation; any other is looked into.
* A BatchNorm2d subclass applying its own activation (timm's BatchNormAct2d) runs as a BatchNorm and fuses
  with the conv before it, the act included (the op's own probe is tested in tests/ops/test_bn_act.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.fusion.graph import canonical_module, is_leaf_module
from opsnn_lab.fusion.probe import probe_modules
from opsnn_lab.testing import assert_close_dtype, seeded


class MatmulLinear(nn.Linear):  # the same function, written out
    def forward(self, x):
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ScaledLinear(nn.Linear):  # Linear-shaped, computes something else
    def forward(self, x):
        return 2.0 * F.linear(x, self.weight, self.bias)


class MLP(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.up, self.act, self.down = cls(12, 24), nn.GELU(), cls(24, 12)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


class InlineGELU(nn.Module):  # the activation inline in a traceable forward: only the fx route reaches it
    def __init__(self, cls):
        super().__init__()
        self.up, self.down = cls(12, 24), cls(24, 12)

    def forward(self, x):
        return x + 0.5 * self.down(F.gelu(self.up(x)))


def _fuses_like_eager(model, pattern, route):
    """fuse() rewrites the one chain by ``route``; the copy saves fewer bytes and matches eager's every grad."""
    torch.manual_seed(0)
    x = seeded(3, 5, 12)
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = plan.decisions
    assert (d.pattern, d.fused, d.route.split(":")[0]) == (pattern, True, route), d.reason
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: eager(x))  # rewritten, not just planned
    out, grads = _grads(fused, x)
    want, want_grads = _grads(eager, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_a_subclass_computing_linear_fuses_with_eagers_numbers():
    _fuses_like_eager(MLP(MatmulLinear), "linear_gelu_linear", "module")


def test_a_subclass_computing_linear_fuses_in_traced_code_too():  # apply traces its own copy: probed as well
    _fuses_like_eager(InlineGELU(MatmulLinear), "linear_gelu_linear", "fx")


@pytest.mark.parametrize("make, route", [(lambda: MLP(MatmulLinear), "module"),
                                         (lambda: InlineGELU(MatmulLinear), "fx")])
def test_a_subclass_computing_linear_is_found_inside_an_autocast_region_too(make, route):
    """Under autocast ``x @ W.T + b`` (bf16 product, fp32 sum) and ``F.linear`` (bf16) differ: the analysis and the
    copy apply() probes run with autocast off, in the model's own dtypes, so fuse() inside autocast works."""
    torch.manual_seed(0)
    model, x = make(), seeded(3, 5, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, plan = ol.fusion.fuse(model, x)
    (d,) = plan.decisions
    assert (d.pattern, d.fused, d.route.split(":")[0]) == ("linear_gelu_linear", True, route), d.reason
    (out, grads), (want, want_grads) = _grads(fused, x), _grads(model, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_a_subclass_computing_something_else_is_looked_into():
    torch.manual_seed(0)
    model = MLP(ScaledLinear)
    probe_modules(model)
    assert not is_leaf_module(model.up)
    plan = ol.fusion.analyze(model, seeded(3, 5, 12))
    assert all(not d.fused for d in plan.decisions)  # F.linear inside it may fuse, never the subclass as a Linear
    probe_modules(mlp := MLP(MatmulLinear))
    assert is_leaf_module(mlp.up) and is_leaf_module(mlp.down)


def test_the_probe_fires_no_user_hook_and_leaves_the_rng_stream_alone():
    model, calls = MLP(MatmulLinear), []
    model.up.register_forward_hook(lambda *a: calls.append(a))
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    probe_modules(model)
    assert not calls and torch.equal(torch.rand(4), want)
    assert is_leaf_module(model.up)


class HandGELU(nn.Module):  # GPT-2's gelu_new written out, as in many training scripts
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class _SwishFn(torch.autograd.Function):  # an activation with its own backward, as Bloom's BloomGelu in training
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


class FnSwish(nn.Module):
    def forward(self, x):
        return _SwishFn.apply(x)


class Cube(nn.Module):  # pointwise, parameter-free, but no activation the fused ops take
    def forward(self, x):
        return x * x * x


class ActMLP(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(12, 24), act, nn.Linear(24, 12)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("act, pattern", [(HandGELU(), "linear_gelu_tanh_linear"), (FnSwish(), "linear_silu_linear")])
def test_a_hand_written_activation_is_named_by_what_it_computes_and_fuses(act, pattern):
    _fuses_like_eager(ActMLP(act), pattern, "module")


class FP32SiLU(nn.Module):  # diffusers' FP32SiLU: SiLU in float32, cast back to the input's dtype
    def forward(self, x):
        return F.silu(x.float()).to(x.dtype)


class FP32GatedMLP(nn.Module):  # Lumina2's feed-forward: down(FP32SiLU(gate(x)) * up(x))
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(12, 24, bias=False), nn.Linear(12, 24, bias=False), nn.Linear(24, 12)
        self.act = FP32SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("make, pattern", [(lambda: ActMLP(FP32SiLU()), "linear_silu_linear"),
                                           (FP32GatedMLP, "gated_mlp_silu")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_an_activation_computing_in_float32_inside_fuses_except_in_a_float64_chain(make, pattern, dtype):
    """In float64 such an activation rounds to float32 (1e-8 off), which the fused op, computing in float64, would
    not: declined there, with why. In float32 and lower the fused op computes it as the module does."""
    torch.manual_seed(0)
    model = make().to(dtype).train()
    x = seeded(3, 5, 12, dtype=dtype)
    fused, plan = ol.fusion.fuse(model, (x,))
    (d,) = [d for d in plan.decisions if d.pattern == pattern]
    if dtype == torch.float64:
        assert not d.fused and "computes silu in float32 inside and casts back" in d.reason, d.reason
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)
    else:  # the gated MLP's packed GEMM sums in another order than eager's two
        assert d.fused, d.reason
        assert_close_dtype(fused(x), model(x))


def test_a_pointwise_module_computing_no_known_activation_is_looked_into():
    model = ActMLP(Cube())
    probe_modules(model)
    assert not is_leaf_module(model.act) and canonical_module(model.act) == "cube"
    plan = ol.fusion.analyze(model, seeded(3, 5, 12))
    assert not any(d.fused for d in plan.decisions)


class BNAct(nn.BatchNorm2d):  # timm's BatchNormAct2d, written out
    def __init__(self, c, act):
        super().__init__(c)
        self.drop, self.act = nn.Identity(), act

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum, self.eps)
        return self.act(self.drop(x))


class MobileBlock(nn.Module):  # pointwise conv -> BNAct(SiLU) -> depthwise conv -> BNAct(ReLU6) -> conv -> BNAct(none)
    def __init__(self, c=6):
        super().__init__()
        e = 2 * c
        self.conv_pw, self.bn1 = nn.Conv2d(c, e, 1, bias=False), BNAct(e, nn.SiLU())
        self.conv_dw, self.bn2 = nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), BNAct(e, nn.ReLU6())
        self.conv_pwl, self.bn3 = nn.Conv2d(e, c, 1, bias=False), BNAct(c, nn.Identity())

    def forward(self, x):
        return x + self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))


def test_a_batch_norm_applying_its_own_activation_fuses_with_its_conv():
    torch.manual_seed(0)
    model, x = MobileBlock(), seeded(2, 6, 9, 9)
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, x)
    got = {d.pattern: (d.fused, d.modules) for d in plan.decisions}
    assert got["conv_bn_silu"] == (True, ["conv_pw", "bn1"]) and got["conv_bn_relu6"] == (True, ["conv_dw", "bn2"])
    assert not any(d.fused for d in plan.decisions if "bn3" in d.modules)  # no activation: BN output to the add
    assert "bn1 (BNAct, with its SiLU)" in next(d.reason for d in plan.decisions if d.pattern == "conv_bn_silu")
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: eager(x))
    for _ in range(2):  # two steps: the running statistics move the same way
        out, grads = _grads(fused, x)
        want, want_grads = _grads(eager, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-4 * g.abs().max().item() + 1e-6, rtol=1e-4, msg=name)
    for name, b in eager.named_buffers():
        torch.testing.assert_close(dict(fused.named_buffers())[name], b, atol=1e-6, rtol=1e-5, msg=name)
    fused.eval()
    eager.eval()
    torch.testing.assert_close(fused(x), eager(x), atol=1e-5, rtol=1e-5)


class OwnGELU(nn.Module):  # timm's own GELU class (timm.layers.activations.GELU): F.gelu behind another class
    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)


class ConvBNActBlock(nn.Module):  # conv -> BNAct(act) -> conv -> BNAct(act), timm's ConvNormAct pairs
    def __init__(self, act, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, 2 * c, 1, bias=False), BNAct(2 * c, act)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c, bias=False)
        self.bn2 = BNAct(2 * c, copy.deepcopy(act))

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x))))


@pytest.mark.parametrize("act, pattern", [(OwnGELU(), "conv_bn_gelu"), (OwnGELU("tanh"), "conv_bn_gelu_tanh"),
                                          (HandGELU(), "conv_bn_gelu_tanh"), (FnSwish(), "conv_bn_silu")])
def test_a_batch_norm_applying_an_activation_of_its_own_class_fuses_as_that_activation(act, pattern):
    """The fusion hands the op the BatchNorm's own child, which the op names by what it computes on a probe. Before,
    the op was handed a stand-in (``nn.GELU`` for timm's GELU class), not the BatchNorm's child, and refused
    ("bn must be BatchNorm2d ..."): efficientformerv2_s0's 30 Conv -> BatchNormAct2d(GELU) chains."""
    torch.manual_seed(0)
    model, x = ConvBNActBlock(act), seeded(2, 4, 7, 7, requires_grad=True)
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, x)
    assert [(d.pattern, d.fused) for d in plan.decisions] == [(pattern, True)] * 2
    out, grads = _grads(fused, x)
    want, want_grads = _grads(eager, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-4 * g.abs().max().item() + 1e-6, rtol=1e-4, msg=name)


def test_the_op_takes_a_batch_norms_own_activation_of_any_class_and_never_a_second_one():
    from opsnn_lab.ops import FusedConvBNAct

    bn = BNAct(8, OwnGELU("tanh"))
    op = FusedConvBNAct.from_modules(nn.Conv2d(4, 8, 1), bn, bn.act)  # named by what it computes on a probe
    assert op.act_spec.name == "gelu_tanh"
    with pytest.raises(TypeError, match="bn must be BatchNorm2d"):  # conv -> bn (with its act) -> another act
        FusedConvBNAct.from_modules(nn.Conv2d(4, 8, 1), bn, nn.GELU(approximate="tanh"))
    with pytest.raises(TypeError, match="or a parameter-free module computing one of them"):
        cubed = BNAct(8, Cube())
        FusedConvBNAct.from_modules(nn.Conv2d(4, 8, 1), cubed, cubed.act)
