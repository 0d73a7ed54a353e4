"""Conv -> BN -> PReLU (face-recognition backbones, UVDoc's conv layers): the conv_bn row fuses it into
FusedConvBNAct with the PReLU's weight, trained as eager's in training and eval; a pool after it and ``F.prelu``
with a weight of the forward's own are declined with the reason."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class ConvBlock(nn.Module):  # MobileFaceNet's: conv, BN, PReLU per channel
    def __init__(self, cin, cout, k=3, stride=1, groups=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False)
        self.bn, self.prelu = nn.BatchNorm2d(cout), nn.PReLU(cout)

    def forward(self, x):
        return self.prelu(self.bn(self.conv(x)))


class IRBlock(nn.Module):  # an IResNet block: BN, conv, BN, PReLU (one slope), conv, BN, + shortcut
    def __init__(self, c):
        super().__init__()
        self.bn1, self.conv1, self.bn2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.prelu, self.conv2, self.bn3 = nn.PReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))


def _grads(model, x):
    out = model(x)
    return out, torch.autograd.grad(out.sin().sum(), list(model.parameters()))


def test_face_recognition_blocks_fuse_and_train_as_eager():
    torch.manual_seed(0)
    model = nn.Sequential(ConvBlock(3, 8, stride=2), ConvBlock(8, 8, groups=8), IRBlock(8)).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.PReLU):
                m.weight.uniform_(0.05, 0.5)
    x = seeded(2, 3, 16, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert plan.summary()["conv_bn_prelu"] == {"fused": 3, "rejected": 0}
    for mode in (True, False):
        model.train(mode), fused.train(mode)
        (out_a, grads_a), (out_b, grads_b) = _grads(model, x), _grads(fused, x)
        torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads_a, grads_b):  # the PReLU weights' among them
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    model.train(), fused.train()
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == eager - ours > 0


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act, self.pool = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.PReLU(), nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(self.act(self.bn(self.conv(x))))


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.slope = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Parameter(torch.full((4,), 0.2))

    def forward(self, x):
        return F.prelu(self.bn(self.conv(x)), self.slope)


def test_a_pool_after_the_prelu_fuses_without_it_and_a_functional_prelu_is_declined():
    x = seeded(2, 3, 9, 9)
    (d,) = [d for d in ol.fusion.analyze(Pooled(), (x,)).decisions if d.pattern.startswith("conv_bn")]
    assert d.pattern == "conv_bn_prelu" and d.fused  # the pool stays a module of its own
    (d,) = [d for d in ol.fusion.analyze(Functional(), (x,)).decisions if d.pattern.startswith("conv_bn")]
    assert d.pattern == "conv_bn_prelu" and not d.fused and "`F.prelu` with a weight" in d.reason


class CallingPReLU(nn.PReLU):  # timm's PReLU: a subclass whose forward calls F.prelu itself
    def forward(self, x):
        return F.prelu(x, self.weight)


class BatchNormAct(nn.BatchNorm2d):  # timm's BatchNormAct2d: a BatchNorm applying its activation child itself
    def __init__(self, c):
        super().__init__(c)
        self.act = CallingPReLU(c)

    def forward(self, x):
        return self.act(super().forward(x))


class GroupNormAct(nn.GroupNorm):
    def __init__(self, c):
        super().__init__(2, c)
        self.act = CallingPReLU()

    def forward(self, x):
        return self.act(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


def test_norm_modules_applying_a_prelu_subclass_fuse_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BatchNormAct(8), nn.Conv2d(8, 8, 3, padding=1),
                          GroupNormAct(8), nn.Conv2d(8, 4, 1)).double()
    x = seeded(2, 3, 9, 9, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert {d.pattern for d in plan.decisions if d.fused} == {"conv_bn_prelu", "group_norm_prelu"}, plan.summary()
    (out_a, grads_a), (out_b, grads_b) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
