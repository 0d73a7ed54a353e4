"""The gated product row: ``act(gate) * up`` fused alone where the projections are not plain Linears (a low-rank
adapter around each, as LoRA fine-tuning builds), with the bytes the plan says, eager's outputs and gradients, and
the refusals said in terms of the computation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class LowRank(nn.Module):
    """A frozen Linear plus a trainable low-rank update: ``base(x) + 2 * B(A(x))``."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.base = nn.Linear(n_in, n_out).requires_grad_(False)
        self.A, self.B = nn.Linear(n_in, 3, bias=False), nn.Linear(3, n_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.3)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x)) * 2.0


class AdapterMLP(nn.Module):
    def __init__(self, act=None, variant=""):
        super().__init__()
        self.gate, self.up, self.down = LowRank(12, 20), LowRank(12, 20), LowRank(20, 12)
        self.act, self.variant = act or nn.SiLU(), variant

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        if self.variant == "broadcast":
            return self.down(self.act(g) * u[..., :1])
        if self.variant == "escapes":
            a = self.act(g)
            return self.down(a * u), a
        return self.down(self.act(g) * u)


def _grads(model, x):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    model.zero_grad(set_to_none=True)
    out.double().sin().sum().backward()
    return [out.detach(), x.grad] + [p.grad for _, p in sorted(model.named_parameters()) if p.requires_grad]


def _product(plan):
    return [d for d in plan.decisions if d.pattern.startswith("gated_product")]


@pytest.mark.parametrize("act, pattern", [(nn.SiLU(), "gated_product_silu"),
                                          (nn.GELU(approximate="tanh"), "gated_product_gelu_tanh")])
def test_adapter_projections_fuse_the_product_with_the_planned_bytes(act, pattern):
    torch.manual_seed(0)
    model, x = AdapterMLP(act), seeded(3, 5, 12)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), x)
    (d,) = _product(plan)
    assert d.pattern == pattern and d.fused and "FusedGatedProduct" in d.reason, d.reason
    assert not [d for d in plan.decisions if d.pattern.startswith("gated_mlp")]  # no Linear projections: no MLP
    measured = activation_bytes(lambda: model(x)) - activation_bytes(lambda: fused(x))
    assert d.saved_bytes == measured == 3 * 5 * 20 * 4  # act(gate), one (tokens, I) fp32 tensor
    for a, b in zip(_grads(model, x), _grads(fused, x), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_refusals_name_the_computation():
    torch.manual_seed(0)
    x = seeded(4, 12)
    (d,) = _product(ol.fusion.analyze(AdapterMLP(nn.ReLU()), x))
    assert not d.fused and "saves 0 of its" in d.reason and "act(gate)" in d.reason, d.reason  # ReLU keeps its output
    (d,) = _product(ol.fusion.analyze(AdapterMLP(variant="broadcast"), x))
    assert not d.fused and "broadcasts" in d.reason, d.reason
    assert _product(ol.fusion.analyze(AdapterMLP(variant="escapes"), x)) == []  # act(gate) read elsewhere: no gate
    (d,) = _product(ol.fusion.analyze(AdapterMLP(), x, patterns=["gated_mlp"]))
    assert not d.fused and "switched off" in d.reason


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(12, 20), nn.Linear(12, 20), nn.Linear(20, 12)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def test_linear_projections_keep_the_whole_gated_mlp():
    torch.manual_seed(0)
    plan = ol.fusion.analyze(SwiGLU(), seeded(3, 12))
    (whole,) = [d for d in plan.fused if d.pattern.startswith("gated_mlp")]
    (product,) = _product(plan)
    assert whole.pattern == "gated_mlp_silu" and not product.fused and "overlaps the fused gated_mlp" in product.reason


def test_variant_names_switch_the_row():
    torch.manual_seed(0)
    x = seeded(4, 12)
    (d,) = _product(ol.fusion.analyze(AdapterMLP(), x, patterns=["gated_product_silu"]))
    assert d.fused
    with pytest.raises(ValueError, match="patterns"):
        ol.fusion.analyze(AdapterMLP(), x, patterns=["gated_product_tanh"])
