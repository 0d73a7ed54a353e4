"""Gated MLP, norm, residual-add + norm and head + loss rows on small hand-written models: each form is found
from the dataflow record (whatever the class is called), the rewrite equals eager in outputs and every
gradient, and each refusal says why in terms of the computation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.testing import seeded

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _run(m, inputs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = m(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    m.zero_grad(set_to_none=True)
    sum(((o.double() * (i + 1)).sin().sum() for i, o in enumerate(outs))).backward()
    return [o.detach() for o in outs] + [x.grad for x in xs if x.requires_grad] + \
        [p.grad for _, p in sorted(m.named_parameters())]


def _same(model, fused, *inputs, dtype=torch.float32):
    """Outputs and the gradients of every parameter and input agree: fp32 within TOL; bf16 by the
    flash-attention criterion (error against an fp64 copy at most 2x eager's own error, plus a floor)."""
    a, b = _run(model, inputs), _run(fused, inputs)
    assert len(a) == len(b)
    if dtype == torch.float32:
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, **TOL[dtype])
        return
    ref = _run(copy.deepcopy(model).double(), [x.double() for x in inputs])
    for x, y, r in zip(a, b, ref):
        err_eager, err_fused = (x.double() - r).abs().max(), (y.double() - r).abs().max()
        assert err_fused <= 2 * err_eager + 1e-3 * r.abs().max(), (float(err_fused), float(err_eager))


def _measured_saving(model, fused, x):
    from opsnn_lab.measuring import activation_bytes

    x = x.detach().requires_grad_()
    return activation_bytes(lambda: model(x), exclude=tuple(model.parameters())) - \
        activation_bytes(lambda: fused(x), exclude=tuple(fused.parameters()))


# --------------------------------------------------------------------------- gated MLP
class SwiGLU(nn.Module):  # functional activation, biases: not Llama's class, the same computation
    def __init__(self, bias=True, swap=False):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(12, 20, bias=bias), nn.Linear(12, 20, bias=bias), nn.Linear(20, 12)
        self.swap = swap

    def forward(self, x):
        return self.w2(self.w3(x) * F.silu(self.w1(x)) if self.swap else F.silu(self.w1(x)) * self.w3(x))


class GeGLU(nn.Module):  # T5's layout: activation module, dropout between the product and the output Linear
    def __init__(self):
        super().__init__()
        self.wi_0, self.wi_1, self.wo = nn.Linear(12, 20, bias=False), nn.Linear(12, 20, bias=False), \
            nn.Linear(20, 12, bias=False)
        self.act, self.dropout = nn.GELU(approximate="tanh"), nn.Dropout(0.0)

    def forward(self, x):
        return self.wo(self.dropout(self.act(self.wi_0(x)) * self.wi_1(x)))


@pytest.mark.parametrize("make, pattern", [(lambda: SwiGLU(), "gated_mlp_silu"),
                                           (lambda: SwiGLU(bias=False, swap=True), "gated_mlp_silu"),
                                           (GeGLU, "gated_mlp_gelu_tanh")])
def test_gated_mlp_fuses_whole_module(make, pattern):
    torch.manual_seed(0)
    model = make()
    x = seeded(3, 5, 12)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern.startswith("gated_mlp")]
    assert d.pattern == pattern and d.fused and d.route == "module:whole" and "FusedGatedMLP" in d.reason
    assert d.saved_bytes > 0 and d.saved_bytes == _measured_saving(model, fused, x)  # the cost model's entry
    assert plan.summary().get(pattern.replace("gated_mlp", "linear"), {}).get("fused", 0) == 0
    _same(model, fused, x)


def test_gated_mlp_refusals_name_the_computation():
    class Leaky(SwiGLU):
        def forward(self, x):
            h = F.silu(self.w1(x)) * self.w3(x)
            return self.w2(h), h  # the product escapes

    class Extra(SwiGLU):
        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x)) * 2.0  # more than the chain in one call

    class Untraceable(SwiGLU):
        def forward(self, x):
            y = self.w2(F.silu(self.w1(x)) * self.w3(x))
            return y * 2.0 if y.sum() > -1e9 else y  # data-dependent: torch.fx cannot trace it

    torch.manual_seed(0)
    x = seeded(2, 12)
    (d,) = [d for d in ol.fusion.analyze(Leaky(), x).decisions if d.pattern.startswith("gated_mlp")]
    assert not d.fused and "also read by" in d.reason
    model = Extra()
    fused, plan = ol.fusion.fuse(model, x)  # the chain is inline code in a traceable forward: the fx route
    (d,) = [d for d in plan.decisions if d.pattern.startswith("gated_mlp")]
    assert d.fused and d.route == "fx:<model>"
    _same(model, fused, x)
    (d,) = [d for d in ol.fusion.analyze(Untraceable(), x).decisions if d.pattern.startswith("gated_mlp")]
    assert not d.fused and "`<model>` also computes sum, gt, mul around the chain" in d.reason


class PackedGLU(nn.Module):  # Phi-3's layout: one Linear computes [gate | up], split by chunk
    def __init__(self, up_first=False, bias=False):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(12, 40, bias=bias), nn.Linear(20, 12, bias=bias)
        self.act, self.up_first = nn.SiLU(), up_first

    def forward(self, x):
        a, b = self.gate_up_proj(x).chunk(2, dim=-1)
        gate, up = (b, a) if self.up_first else (a, b)
        return self.down_proj(up * self.act(gate))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_gate_up_projection_fuses_and_keeps_its_weight(bias):
    torch.manual_seed(0)
    model = PackedGLU(bias=bias)
    x = seeded(3, 5, 12)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern.startswith("gated_mlp")]
    assert d.pattern == "gated_mlp_silu" and d.fused and d.route == "module:whole", d.reason
    assert d.saved_bytes > 0 and d.saved_bytes == _measured_saving(model, fused, x)
    assert list(fused.state_dict()) == list(model.state_dict())
    _same(model, fused, x)


class PackedInline(PackedGLU):  # the chain plus an op in one traceable forward: the fx route, getitem per half
    def forward(self, x):
        return super().forward(x) * 2.0


@pytest.mark.parametrize("make, route", [(PackedGLU, "module:whole"), (PackedInline, "fx:<model>")])
def test_packed_gate_up_with_the_gate_second_fuses(make, route):
    # diffusers' GEGLU / SwiGLU: ``hidden, gate = proj(x).chunk(2, -1)``, told by the recorded tensors (a module
    # call) or by the getitem that feeds the activation (traced code)
    torch.manual_seed(0)
    model, x = make(up_first=True, bias=True), seeded(3, 5, 12)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern.startswith("gated_mlp")]
    assert d.fused and d.route == route and d.params["gate_first"] is False, d.reason
    assert d.saved_bytes > 0 and d.saved_bytes == _measured_saving(model, fused, x)
    _same(model, fused, x)


def test_packed_gate_up_inline_in_traceable_code_fuses_through_fx():
    torch.manual_seed(0)
    model, x = PackedInline(bias=True), seeded(3, 5, 12)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern.startswith("gated_mlp")]
    assert d.fused and d.route == "fx:<model>", d.reason
    _same(model, fused, x)


# --------------------------------------------------------------------------- norms written in Python
class Normalizer(nn.Module):  # an RMSNorm under another name, eps recorded in the code
    def __init__(self, n, offset=False):
        super().__init__()
        self.weight, self.offset = nn.Parameter(torch.randn(n)), offset

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-3)
        return ((1.0 + self.weight) if self.offset else self.weight) * h.to(x.dtype)


class PyLayerNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(n)), nn.Parameter(torch.randn(n))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class BareLayerNorm(nn.Module):  # OLMo's OlmoLayerNorm: no parameters, fp32 inside, the input's dtype out
    def __init__(self, n, inner=torch.float32):
        super().__init__()
        self.normalized_shape, self.inner = (n,), inner

    def forward(self, x):
        return F.layer_norm(x.to(self.inner), self.normalized_shape, None, None, eps=1e-5).to(x.dtype)


class BareRMSNorm(nn.Module):  # a weight-free RMSNorm written out (a QK-norm or a pre-norm without scale)
    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class NotANorm(nn.Module):  # the same ops over the wrong dim: recorded like a norm, computes something else
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6))


class Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(16, 16), norm, nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.norm(self.lin(x)))


@pytest.mark.parametrize("norm, pattern, params", [
    (lambda: Normalizer(16), "rms_norm", {"kind": "rms", "eps": 1e-3, "offset": 0.0}),
    (lambda: Normalizer(16, offset=True), "rms_norm", {"kind": "rms", "eps": 1e-3, "offset": 1.0}),
    (lambda: PyLayerNorm(16), "layer_norm", {"kind": "layer", "eps": 1e-5, "offset": 0.0}),
    (lambda: nn.RMSNorm(16, eps=1e-4), "rms_norm", {"kind": "rms_norm"}),
    (lambda: nn.LayerNorm(16), "layer_norm", {"kind": "layer_norm"}),
    (lambda: BareLayerNorm(16), "layer_norm", {"kind": "layer", "eps": 1e-5, "offset": 0.0, "shape": (16,)}),
    (lambda: BareRMSNorm(), "rms_norm", {"kind": "rms", "eps": 1e-6, "offset": 0.0, "shape": (16,)}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_modules_are_recognised_by_what_they_compute(norm, pattern, params, dtype):
    torch.manual_seed(0)
    model = Net(norm()).to(dtype)
    x = seeded(3, 7, 16, dtype=dtype)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = plan.decisions
    assert d.pattern == pattern and d.fused and d.modules == ["norm"] and d.params == params, d
    assert d.saved_bytes == _measured_saving(model, fused, x)  # the cost model's entry is what a step saves
    _same(model, fused, x, dtype=dtype)


def test_a_norm_without_parameters_computing_in_a_coarser_dtype_is_refused_with_the_reason():
    torch.manual_seed(0)
    (d,) = ol.fusion.analyze(Net(BareLayerNorm(16, inner=torch.bfloat16)), seeded(3, 7, 16)).decisions
    assert d.pattern == "layer_norm" and not d.fused and d.modules == ["norm"]
    assert d.reason == ("`norm`: it casts to bfloat16 inside and computes LayerNorm there, which differs from "
                        "LayerNorm of its float32 input by more than float32 rounding; FusedLayerNorm computes in "
                        "float32 and rounds once to the input dtype")


def test_an_fp64_norm_that_computes_in_fp32_inside_is_refused_and_an_fp64_one_fuses():
    """Hugging Face's RMSNorms cast to fp32 inside: in an fp64 model the fused op (fp64) would change the result."""
    torch.manual_seed(0)
    (d,) = ol.fusion.analyze(Net(Normalizer(16)).double(), seeded(3, 7, 16, dtype=torch.float64)).decisions
    assert d.pattern == "rms_norm" and not d.fused
    assert d.reason == ("`norm`: it casts to float32 inside and computes RMSNorm there, which differs from RMSNorm "
                        "of its float64 input by more than float64 rounding; FusedRMSNorm computes in float64 and "
                        "rounds once to the input dtype")
    model = Net(PyLayerNorm(16)).double()
    x = seeded(3, 7, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, x)
    assert [d.fused for d in plan.decisions] == [True]
    _same(model, fused, x, dtype=torch.float64)


def test_a_module_that_only_looks_like_a_norm_is_no_candidate():
    torch.manual_seed(0)
    assert ol.fusion.analyze(Net(NotANorm(16)), seeded(3, 16)).decisions == []


class SplitNorms(nn.Module):
    """A selective-scan mixer's projection split into ``dt``, ``B``, ``C`` of different widths, each through its own
    weight-free RMSNorm (with a dummy weight buffer of another size, as some do): each norm reads its own part."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(16, 2 + 8 + 8), nn.Linear(18, 4)
        self.dt_norm, self.b_norm, self.c_norm = BareRMSNorm(), BareRMSNorm(), BareRMSNorm()
        self.dt_norm.register_buffer("weight", torch.ones(64), persistent=False)

    def forward(self, x):
        dt, b, c = torch.split(self.proj(x), [2, 8, 8], dim=-1)
        return self.out(torch.cat([self.dt_norm(dt), self.b_norm(b) * 2, self.c_norm(c)], -1))


def test_norms_of_the_parts_of_a_split_read_their_own_part():
    torch.manual_seed(0)
    model = SplitNorms()
    x = seeded(3, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    assert sorted(d.modules[0] for d in plan.decisions if d.fused) == ["b_norm", "c_norm", "dt_norm"]
    assert [fused.get_submodule(n).forward.op.normalized_shape for n in ("dt_norm", "b_norm", "c_norm")] == \
        [(2,), (8,), (8,)]
    _same(model, fused, x)


# --------------------------------------------------------------------------- residual add + norm
class Residual(nn.Module):
    """``x + lin(x)``, its norm and the Linear reading the norm (a LayerNorm fuses only where its output is kept)."""

    def __init__(self, norm):
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(16, 16), norm, nn.Linear(16, 16)

    def forward(self, x):
        s = x + self.lin(x)
        return self.out(self.norm(s)), s


@pytest.mark.parametrize("norm, pattern", [(lambda: nn.LayerNorm(16), "add_layer_norm"),
                                           (lambda: nn.RMSNorm(16, eps=1e-5), "add_rms_norm")])
def test_residual_add_and_built_in_norm_fuse_in_traceable_code(norm, pattern):
    torch.manual_seed(0)
    model = Residual(norm())
    x = seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern == pattern]
    assert d.fused and d.route.startswith("fx:") and d.modules == ["<model>", "norm"]
    (alone,) = [d for d in plan.decisions if d.pattern == pattern.removeprefix("add_")]
    assert not alone.fused and f"overlaps the fused {pattern}" in alone.reason
    _same(model, fused, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the fused op on the fp32 sum, as eager autocast computes it
        torch.testing.assert_close(fused(x)[0], model(x)[0])


@pytest.mark.parametrize("norm, pattern, params", [
    (lambda: Normalizer(16), "add_rms_norm", {"kind": "rms", "eps": 1e-3, "offset": 0.0}),
    (lambda: Normalizer(16, offset=True), "add_rms_norm", {"kind": "rms", "eps": 1e-3, "offset": 1.0}),
    (lambda: PyLayerNorm(16), "add_layer_norm", {"kind": "layer", "eps": 1e-5, "offset": 0.0}),
    (lambda: BareLayerNorm(16), "add_layer_norm", {"kind": "layer", "eps": 1e-5, "offset": 0.0, "shape": (16,)}),
    (BareRMSNorm, "add_rms_norm", {"kind": "rms", "eps": 1e-6, "offset": 0.0, "shape": (16,)})])
def test_residual_add_and_python_norm_fuse_in_traceable_code(norm, pattern, params):
    """fx inlines a norm written in Python (Llama's, Gemma's, T5's): its ops are matched in the traced forward with
    the verdict the run-time record reached, and a plan from JSON (no record) rewrites it from its params. A norm
    without parameters (OLMo's, NanoChat's) takes the size it normalises from the record, or from the plan."""
    torch.manual_seed(0)
    model = Residual(norm())
    x = seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = [d for d in plan.decisions if d.pattern == pattern]
    assert d.fused and d.route == "fx:<model>" and d.modules == ["<model>", "norm"] and d.params == params, d
    (alone,) = [d for d in plan.decisions if d.pattern == pattern.removeprefix("add_")]
    assert not alone.fused and f"overlaps the fused {pattern}" in alone.reason
    assert d.saved_bytes == _measured_saving(model, fused, x)
    _same(model, fused, x)
    again = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    assert any(type(m).__name__ == "FusedSlot" for m in again.modules())
    _same(model, again, x)


def test_residual_add_the_rewrite_cannot_reach_leaves_the_norm_to_fuse_alone():
    class Untraceable(Residual):
        def forward(self, x):
            s = x + self.lin(x)
            if s.sum() > -1e9:  # data-dependent control flow: torch.fx cannot trace this forward
                return self.norm(s), s
            return s, s

    torch.manual_seed(0)
    model = Untraceable(Normalizer(16))
    x = seeded(2, 5, 16)
    fused, plan = ol.fusion.fuse(model, x)
    add = next(d for d in plan.decisions if d.pattern == "add_rms_norm")
    assert not add.fused and "cannot be rewritten: `add` runs inline in `<model>`.forward" in add.reason
    norm = next(d for d in plan.decisions if d.pattern == "rms_norm")
    assert norm.fused and norm.route == "module:whole"
    _same(model, fused, x)


def test_norm_whose_inside_escapes_is_refused():
    class Peek(Normalizer):
        def forward(self, x):
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)
            self.last = r
            return self.weight * (x * r)

    class Reader(Net):
        def forward(self, x):
            y = self.norm(self.lin(x))
            return self.out(y) * self.norm.last.mean()

    torch.manual_seed(0)
    (d,) = ol.fusion.analyze(Reader(Peek(16)), seeded(3, 16)).decisions
    assert not d.fused and "`norm.rsqrt` inside `norm` is also read outside it" in d.reason


# --------------------------------------------------------------------------- head + cross-entropy
class LM(nn.Module):
    def __init__(self, return_logits, mapped=False):
        super().__init__()
        self.body, self.head, self.return_logits = nn.Linear(8, 8), nn.Linear(8, 30), return_logits
        self.mapped = mapped

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        if self.mapped:  # Cohere's scale, then Gemma 2's cap: what lm_head_loss's logit map computes
            logits = logits * 0.0625
            logits = torch.tanh(logits / 30.0) * 30.0
        loss = F.cross_entropy(logits.view(-1, 30).float(), labels.view(-1))
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("return_logits, words", [(True, "returned by the model's forward"),
                                                  (False, "read only by the loss")])
def test_head_and_loss_are_reported_with_the_recipe(return_logits, words, mapped):
    torch.manual_seed(0)
    labels = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(0))
    plan = ol.fusion.analyze(LM(return_logits, mapped), (seeded(2, 5, 8), labels))
    (d,) = [d for d in plan.decisions if d.pattern == "linear_cross_entropy"]
    assert not d.fused and d.modules == ["head"] and words in d.reason and "ol.ops.lm_head_loss" in d.reason
