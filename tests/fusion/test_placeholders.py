"""``nn.Identity`` placeholders inside a chain (timm's ``drop_block`` between BN and act, an Mlp's ``norm``
between dropout and fc2, a ConvMlp's ``norm`` between fc1 and act, a gated MLP's ``norm`` before ``down``) are
looked past: the chain fuses with the
identity among its modules, by every route, and matches eager. An identity read twice ends the chain."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.testing import seeded


class Mlp(nn.Module):  # timm's Mlp: fc1 -> act -> drop1 -> norm (Identity) -> fc2 -> drop2
    def __init__(self, d=12):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.0)
        self.norm, self.fc2 = nn.Identity(), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(self.norm(self.drop1(self.act(self.fc1(x)))))


class ConvBlock(nn.Module):  # timm's ResNet block start: conv -> bn -> drop_block (Identity) -> act -> aa (Identity)
    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.drop_block, self.act, self.aa = nn.Identity(), nn.ReLU(), nn.Identity()
        self.out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.out(self.aa(self.act(self.drop_block(self.bn(self.conv(x))))))


class ConvMlp(nn.Module):  # timm's ConvMlp: fc1 -> norm (Identity) -> act -> drop -> fc2, 1x1 convs
    def __init__(self, c=6):
        super().__init__()
        self.fc1, self.norm, self.act = nn.Conv2d(c, 3 * c, 1), nn.Identity(), nn.GELU()
        self.drop, self.fc2 = nn.Dropout(0.0), nn.Conv2d(3 * c, c, 1)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.norm(self.fc1(x)))))


class NormFirstMlp(nn.Module):  # the placeholder between a Linear and its activation, two of them in a row
    def __init__(self, d=12):
        super().__init__()
        self.fc1, self.norm, self.pre, self.act = nn.Linear(d, 2 * d), nn.Identity(), nn.Identity(), nn.SiLU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.pre(self.norm(self.fc1(x)))))


class InlineConvMlp(ConvMlp):  # the activation inline and a residual add: only the fx route reaches the chain
    def forward(self, x):
        return x + self.fc2(F.gelu(self.norm(self.fc1(x))))


class InlineMlp(Mlp):  # the activation inline and a residual add: only the fx route reaches the chain
    def forward(self, x):
        return x + self.fc2(self.norm(F.gelu(self.fc1(x))))


class GluModule(nn.Module):
    def __init__(self, d=12):
        super().__init__()
        self.gate, self.up, self.norm, self.down, self.act = (nn.Linear(d, 2 * d), nn.Linear(d, 2 * d),
                                                              nn.Identity(), nn.Linear(2 * d, d), nn.SiLU())

    def forward(self, x):
        return self.down(self.norm(self.act(self.gate(x)) * self.up(x)))


class Twice(nn.Module):  # the identity's output is read twice: not a placeholder inside one chain
    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn, self.mid, self.act = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Identity(), \
            nn.ReLU()

    def forward(self, x):
        h = self.mid(self.bn(self.conv(x)))
        return self.act(h) + h


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


CASES = {
    "mlp": (Mlp, (3, 5, 12), "linear_gelu_dropout_linear", ["fc1", "act", "drop1", "norm", "fc2"], "module"),
    "conv": (ConvBlock, (2, 4, 6, 6), "conv_bn_relu", ["conv", "bn", "drop_block", "act"], "module"),
    "fx": (InlineMlp, (3, 5, 12), "linear_gelu_linear", ["fc1", "norm", "fc2"], "fx"),
    "conv_mlp": (ConvMlp, (2, 6, 5, 7), "conv_gelu_dropout_conv", ["fc1", "norm", "act", "drop", "fc2"], "module"),
    "norm_first": (NormFirstMlp, (3, 5, 12), "linear_silu_linear", ["fc1", "norm", "pre", "act", "fc2"], "module"),
    "conv_mlp_fx": (InlineConvMlp, (2, 6, 5, 7), "conv_gelu_conv", ["fc1", "norm", "fc2"], "fx"),
    "gated": (GluModule, (3, 5, 12), "gated_mlp_silu", ["gate", "act", "up", "norm", "down"], "module"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_chain_fuses_past_its_identity_placeholders(case):
    cls, shape, pattern, modules, route = CASES[case]
    torch.manual_seed(0)
    model, x = cls().train(), seeded(*shape)
    eager = copy.deepcopy(model)
    fused, plan = ol.fusion.fuse(model, x)
    d = next(d for d in plan.decisions if d.pattern == pattern)
    assert d.fused and d.route.split(":")[0] == route, d.reason
    assert d.modules == modules
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: eager(x))
    out, grads = _step(fused, x)
    want, want_grads = _step(eager, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-4 * g.abs().max().item() + 1e-6, rtol=1e-4, msg=name)


def test_a_plan_read_back_from_json_applies_past_the_identity():
    model, x = Mlp(), seeded(3, 5, 12)
    plan = ol.fusion.analyze(model, x)
    fused = ol.fusion.apply(model, ol.fusion.FusionPlan.from_json(plan.to_json()))
    torch.testing.assert_close(fused(x), model(x))
    assert activation_bytes(lambda: fused(x)) < activation_bytes(lambda: model(x))


class ReadTwice(nn.Module):  # the placeholder before the activation is also read by the residual
    def __init__(self, c=6):
        super().__init__()
        self.fc1, self.norm, self.act, self.fc2 = nn.Conv2d(c, c, 1), nn.Identity(), nn.GELU(), nn.Conv2d(c, c, 1)

    def forward(self, x):
        h = self.norm(self.fc1(x))
        return self.fc2(self.act(h)) + h


def test_an_identity_before_the_activation_read_twice_is_no_chain():
    plan = ol.fusion.analyze(ReadTwice().train(), seeded(2, 6, 5, 5))
    assert not [d for d in plan.decisions if d.fused], [d.reason for d in plan.decisions]


def test_an_identity_read_twice_ends_the_chain():
    plan = ol.fusion.analyze(Twice().train(), seeded(2, 4, 6, 6))
    (d,) = [d for d in plan.decisions if d.modules[:2] == ["conv", "bn"]]
    assert not d.fused and "`mid`" in d.reason


@pytest.mark.parametrize("where", ["fc1", "act", "norm", "fc2"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_chain_with_a_users_hook_on_one_of_its_modules_is_not_fused(where, kind):
    """Fused, the chain's modules no longer compute their own outputs (the first runs the op, the rest pass its
    result through): a user's hook on any of them would see other tensors than in eager, so the chain is
    declined with the reason, and the hook keeps seeing what it sees in eager."""
    torch.manual_seed(0)
    model, x = Mlp().train(), seeded(3, 5, 12, requires_grad=True)
    seen = []

    def hook(module, *args):
        seen.append([tuple(t.shape) for a in args for t in (a if isinstance(a, tuple) else (a,))
                     if isinstance(t, torch.Tensor)])

    getattr(getattr(model, where), f"register_{kind}_hook")(hook)
    fused, plan = ol.fusion.fuse(model, x)
    assert not [d for d in plan.decisions if d.fused and where in d.modules]
    if kind != "full_backward":  # a full backward hook's own autograd nodes already end the chain at its module
        (d,) = plan.decisions
        assert not d.fused and d.reason.startswith(f"`{where}` has a hook of its own"), d.reason
    for m in (model, fused):
        seen.clear()
        m(x).sum().backward()
        if m is model:
            want = list(seen)
    assert seen == want and seen
