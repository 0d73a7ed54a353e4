"""nn.Linear subclasses with their own forward: one that computes F.linear (Falcon's ``FalconLinear``,
``x @ W.T + b``) runs as one Linear in the record and fuses; one that computes anything else is looked into
as before, and its Linear-shaped parameters never reach a fused op."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.graph import is_leaf_module, probe_linears
from opsnn_lab.testing import seeded


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


def test_a_subclass_computing_linear_fuses_with_eagers_numbers():
    torch.manual_seed(0)
    model, x = MLP(MatmulLinear), seeded(3, 5, 12)
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, x)
    (d,) = plan.decisions
    assert d.pattern == "linear_gelu_linear" and d.fused, d.reason
    out, grads = _grads(fused, x)
    want, want_grads = _grads(eager, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_a_subclass_computing_something_else_is_looked_into():
    torch.manual_seed(0)
    model = MLP(ScaledLinear)
    probe_linears(model)
    assert not is_leaf_module(model.up)
    plan = ol.fusion.analyze(model, seeded(3, 5, 12))
    assert all(not d.fused for d in plan.decisions)  # F.linear inside it may fuse, never the subclass as a Linear
    probe_linears(mlp := MLP(MatmulLinear))
    assert is_leaf_module(mlp.up) and is_leaf_module(mlp.down)


def test_the_probe_fires_no_user_hook_and_leaves_the_rng_stream_alone():
    model, calls = MLP(MatmulLinear), []
    model.up.register_forward_hook(lambda *a: calls.append(a))
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    probe_linears(model)
    assert not calls and torch.equal(torch.rand(4), want)
    assert is_leaf_module(model.up)
