"""A fused op's backward is written by hand and has no derivative of its own: a gradient of its gradient
(``create_graph=True``: a gradient penalty, a Hessian-vector product) raises, naming the op, where it was silently
wrong (1.8 apart on Linear -> GELU -> Linear, 3.0 on Linear -> LayerNorm -> Linear, zero gradients through
Conv -> BN -> act). First-order gradients, with or without ``retain_graph``, are unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.testing import seeded


class Gated(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 16, bias=False), nn.Linear(d, 16, bias=False), nn.Linear(16, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x):
        probs = self.drop(torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 3, -1))
        return probs @ self.v(x)


def _linear_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8)), seeded(4, 8)


CASES = {  # model, input, a pattern that must fuse
    "linear_gelu_dropout_linear": lambda: _linear_mlp(),
    "conv_bn_relu": lambda: (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), seeded(2, 3, 6, 6)),
    "layer_norm": lambda: (nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)), seeded(4, 8)),
    "gated_mlp_silu": lambda: (Gated(), seeded(4, 8)),
    "attention": lambda: (Attention(), seeded(2, 5, 8)),
    "group_norm_silu": lambda: (nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 4, 3)), seeded(2, 4, 6, 6)),
    "conv_gelu_conv": lambda: (nn.Sequential(nn.Conv2d(4, 16, 1), nn.GELU(), nn.Conv2d(16, 4, 1)), seeded(2, 4, 6, 6)),
    "dropout_linear": lambda: (nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 8)), seeded(4, 8)),
}


@pytest.mark.parametrize("pattern", sorted(CASES))
def test_a_gradient_of_a_fused_ops_gradient_raises_and_first_order_gradients_run(pattern):
    torch.manual_seed(0)
    model, x = CASES[pattern]()
    model = model.double().train()
    x = x.double()
    fused, plan = ol.fusion.fuse(model, (x,))
    assert pattern in {d.pattern for d in plan.fused}, [d.reason for d in plan.decisions]
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fused(xx).square().sum(), xx, retain_graph=True)  # first order: as before
    assert torch.isfinite(g).all()
    with pytest.raises(RuntimeError, match="has no second derivative: a gradient of its gradient"):
        torch.autograd.grad(fused(xx).square().sum(), xx, create_graph=True)
    (want,) = torch.autograd.grad(model(xx).square().sum(), xx, create_graph=True)  # eager: as it was
    assert want.requires_grad


def test_the_head_loss_and_the_counter_dropout_say_so_too():
    h = seeded(6, 8, dtype=torch.float64, requires_grad=True)
    w = seeded(11, 8, dtype=torch.float64, seed=1, requires_grad=True)
    loss = ol.ops.linear_cross_entropy(h, w, torch.arange(6) % 11)
    with pytest.raises(RuntimeError, match="FusedLinearCrossEntropy has no second derivative"):
        torch.autograd.grad(loss, h, create_graph=True)
    drop = ol.ops.Dropout(0.5, seed=3).train()
    with pytest.raises(RuntimeError, match="the counter-RNG dropout has no second derivative"):
        torch.autograd.grad(drop(h).square().sum(), h, create_graph=True)
