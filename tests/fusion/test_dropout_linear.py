"""The dropout_linear row: ``linear(dropout(x))`` fused where only the Linear reads the dropped copy (a
classifier head, LoRA's adapter input), as a module chain and as inline code; with ``make_reproducible`` the
fused model draws the unfused model's masks, so outputs and every gradient are eager's."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class Head(nn.Module):
    def __init__(self, p=0.2, functional=False, inplace_after=False):
        super().__init__()
        self.body, self.drop, self.classifier = nn.Linear(12, 16), nn.Dropout(p), nn.Linear(16, 5)
        self.p, self.functional, self.inplace_after = p, functional, inplace_after

    def forward(self, x):
        h = torch.tanh(self.body(x))
        h = F.dropout(h, self.p, self.training) if self.functional else self.drop(h)
        y = self.classifier(h)
        return y.mul_(2.0) if self.inplace_after else y


class MLP(nn.Module):  # Linear -> GELU -> Dropout -> Linear: the MLP row takes the dropout
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(12, 24), nn.GELU(), nn.Dropout(0.1), nn.Linear(24, 12)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


def _steps(model, x):
    ol.consistency.make_reproducible(model, 5)
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    model.zero_grad(set_to_none=True)
    out.double().sin().sum().backward()
    return [out.detach(), x.grad] + [p.grad for _, p in sorted(model.named_parameters())]


def _dropout_decisions(plan):
    return [d for d in plan.decisions if d.pattern == "dropout_linear"]


def test_module_chain_and_inline_dropout_fuse_with_the_planned_bytes_and_eager_gradients():
    for functional in (False, True):
        torch.manual_seed(0)
        model, x = Head(functional=functional), seeded(6, 12)
        fused, plan = ol.fusion.fuse(copy.deepcopy(model), x)
        (d,) = _dropout_decisions(plan)
        assert d.fused and "FusedDropoutLinear" in d.reason, d.reason
        assert d.route.startswith("fx:" if functional else "module:"), d.route

        def run(m, x=x):
            def f():
                torch.manual_seed(1)
                return m(x)
            return f
        measured = activation_bytes(run(model), exclude=tuple(model.parameters())) - \
            activation_bytes(run(fused), exclude=tuple(fused.parameters()))
        assert d.saved_bytes == measured > 0
        for a, b in zip(_steps(model, x), _steps(fused, x), strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
        model.eval(), fused.eval()  # eval: the Linear alone, through the op (the module itself passes it on)
        torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-6)


def test_no_candidate_without_a_mask_and_refusals_name_the_reason():
    x = seeded(6, 12)
    assert _dropout_decisions(ol.fusion.analyze(Head(p=0.0), x)) == []  # an identity: nothing to save
    (d,) = _dropout_decisions(ol.fusion.analyze(Head(inplace_after=True), x))
    assert not d.fused and "modified in place" in d.reason, d.reason
    plan = ol.fusion.analyze(MLP(), x)
    (d,) = _dropout_decisions(plan)
    assert not d.fused and "overlaps the fused linear_gelu_dropout_linear" in d.reason, d.reason
