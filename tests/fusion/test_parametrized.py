"""Modules whose weight is computed at each access (``torch.nn.utils.parametrizations``: weight_norm,
spectral_norm) and buffers a forward moves: fusion declines the chains it cannot run as eager does, says why, and
leaves every buffer as the model has it (a spectral norm's power iteration state, a count)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import opsnn_lab as ol
from opsnn_lab.testing import seeded


class Counts(nn.Module):
    """A buffer its forward moves (a step count, an EMA)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.seen += 1
        return x


class Block(nn.Module):
    """Hand-written attention (fx fuses its core and the residual LayerNorm), a Linear -> GELU -> Linear MLP, a
    Conv -> BN -> ReLU stem; each Linear / Conv may be parametrized."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2, self.ln = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)
        self.conv, self.bn, self.count = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Counts()

    def forward(self, x, img):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 4, -1) @ self.v(x)
        h = self.ln(x + self.o(a))
        c = torch.relu(self.bn(self.conv(img))).mean()
        return self.count(self.fc2(F.gelu(self.fc1(h))) + c)


def _inputs():
    return seeded(2, 5, 16, dtype=torch.float64), seeded(2, 3, 8, 8, dtype=torch.float64, seed=1)


def _steps(model, inputs, n=2):
    """Outputs and gradients of ``n`` training steps, each followed by a fixed update of every Parameter."""
    out = []
    for _ in range(n):
        y = model(*inputs)
        grads = torch.autograd.grad((y * seeded(*y.shape, dtype=y.dtype, seed=3)).sum(), list(model.parameters()))
        out.append((y.detach(), grads))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= 0.05 * g
    return out


@pytest.mark.parametrize("parametrize", [weight_norm, spectral_norm, orthogonal], ids=lambda f: f.__name__)
def test_a_parametrized_module_ends_no_fused_chain_and_the_plan_says_why(parametrize):
    torch.manual_seed(0)
    model = Block().double().train()
    for name in ("q", "fc1", "conv"):
        parametrize(getattr(model, name))
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, _inputs())
    declined = {d.pattern: d.reason for d in plan.decisions if not d.fused}
    for pattern, module in (("qkv", "q"), ("linear_gelu_linear", "fc1"), ("conv_bn_relu", "conv")):
        assert f"`{module}` has a parametrization (weight:" in declined[pattern]
    assert {d.pattern for d in plan.fused} == {"attention", "add_layer_norm"}  # the rest still fuses
    for (y, grads), (want, want_grads) in zip(_steps(fused, _inputs()), _steps(eager, _inputs())):
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_fusing_moves_no_buffer_of_the_model_nor_of_its_fused_copy():
    """Analysis runs the model's code more than once (the recorded forward, the questions a region's code asks on
    the example, probes of modules) and the rewrite runs the copy's: a spectral norm's power iteration and a count
    moved there, so the fused model started a step ahead of the model (3e-5 apart at the first step)."""
    torch.manual_seed(0)
    model = Block().double().train()
    spectral_norm(model.fc1)
    before = {k: b.clone() for k, b in model.named_buffers()}
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, _inputs())
    assert plan.fused
    for k, b in model.named_buffers():
        assert torch.equal(b, before[k]), k
    for k, b in fused.named_buffers():
        assert torch.equal(b, before[k]), k
    for (y, _), (want, _) in zip(_steps(fused, _inputs()), _steps(eager, _inputs())):
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert float(fused.count.seen) == float(eager.count.seen) == 2
