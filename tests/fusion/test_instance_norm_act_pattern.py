"""The instance_norm_<act> row: an nnU-Net-style 3-d encoder (Conv3d -> InstanceNorm3d -> LeakyReLU modules in a
Sequential: module chains) and an image-to-image block calling ``F.leaky_relu`` on its norm (the fx route) fuse and
train as eager, running statistics included; the plan's saving is the measured one; an in-place activation (which
already keeps no more than the fused op) and a ReLU are declined with the reason, and a conv before an
InstanceNorm is no conv_bn candidate; a dropout of p=0 between a norm and its activation (MONAI's norm, dropout,
activation Sequential) joins the chain, which runs unfused once its p changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class ConvNormAct(nn.Module):  # nnU-Net's ConvDropoutNormReLU: one Sequential of conv, norm, nonlinearity
    def __init__(self, cin, cout, stride=1, inplace=False):
        super().__init__()
        conv, norm = nn.Conv3d(cin, cout, 3, stride, 1), nn.InstanceNorm3d(cout, affine=True)
        self.all_modules = nn.Sequential(conv, norm, nn.LeakyReLU(0.01, inplace=inplace))

    def forward(self, x):
        return self.all_modules(x)


def encoder(inplace=False):
    return nn.Sequential(ConvNormAct(1, 4, inplace=inplace), ConvNormAct(4, 4, inplace=inplace),
                         ConvNormAct(4, 8, 2, inplace=inplace), nn.Conv3d(8, 2, 1))


class ResidualBlock(nn.Module):  # an image-to-image generator's block, its activation called in the forward
    def __init__(self, c=6, track=False):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.norm1 = nn.InstanceNorm2d(c, track_running_stats=track)
        self.norm2 = nn.InstanceNorm2d(c, track_running_stats=track)

    def forward(self, x):
        h = F.leaky_relu(self.norm1(self.conv1(F.pad(x, (1, 1, 1, 1), mode="reflect")[..., 1:-1, 1:-1])), 0.2)
        return x + self.norm2(self.conv2(h))


def _grads(model, x):
    out = model(x)
    return out, torch.autograd.grad(out.sin().sum(), list(model.parameters()))


def _fuses_like_eager(model, x, route):
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    decisions = [d for d in plan.decisions if d.pattern.startswith("instance_norm_") and d.fused]
    assert decisions and all(d.fused and d.route.startswith(route) for d in decisions), plan.summary()
    (out_a, grads_a), (out_b, grads_b) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for a, b in zip(model.buffers(), fused.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == eager - ours > 0
    return fused, decisions, ours / eager


def test_a_3d_segmentation_encoder_fuses_every_block_as_a_module_chain():
    torch.manual_seed(0)
    model = encoder().double()
    _, decisions, ratio = _fuses_like_eager(model, seeded(2, 1, 8, 8, 8, dtype=torch.float64), "module")
    assert [d.pattern for d in decisions] == ["instance_norm_leaky_relu"] * 3
    assert ratio < 0.75  # each block's conv input, norm input and normalised map: the normalised ones go


def test_a_generator_block_fuses_through_fx_with_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(ResidualBlock(track=True), ResidualBlock(track=True)).double()
    fused, decisions, _ = _fuses_like_eager(model, seeded(2, 6, 7, 9, dtype=torch.float64), "fx")
    assert [(d.pattern, d.modules) for d in decisions] == [("instance_norm_leaky_relu", ["0.norm1"]),
                                                           ("instance_norm_leaky_relu", ["1.norm1"])]
    x = seeded(2, 6, 7, 9, seed=3, dtype=torch.float64)
    torch.testing.assert_close(fused.eval()(x), model.eval()(x), rtol=1e-12, atol=1e-12)  # the running stats


def test_refusals_say_why():
    x = seeded(2, 1, 8, 8, 8)
    plan = ol.fusion.analyze(encoder(inplace=True), (x,))
    found = [d for d in plan.decisions if d.pattern.startswith("instance_norm_")]
    assert len(found) == 3 and not any(d.fused for d in found)
    assert all("under 10%" in d.reason for d in found), [d.reason for d in found]  # eager keeps no more in place
    assert not any(d.pattern.startswith("conv_bn") for d in plan.decisions)  # an InstanceNorm is no batch norm
    relu = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1))
    (d,) = ol.fusion.analyze(relu, (seeded(2, 3, 9, 9),)).decisions
    assert d.pattern == "instance_norm_relu" and not d.fused and "a ReLU keeps its output" in d.reason
    tanh = nn.Sequential(nn.InstanceNorm1d(4), nn.Tanh())
    (d,) = ol.fusion.analyze(tanh, (seeded(2, 4, 9),)).decisions
    assert d.pattern == "instance_norm_act" and not d.fused and "not one activation of" in d.reason


def adn_block(cin, cout, norm, p=0.0, act=None):  # MONAI's Convolution: conv, then a Sequential of norm, dropout, act
    adn = nn.Sequential()
    adn.add_module("N", norm(cout))
    adn.add_module("D", nn.Dropout(p))
    adn.add_module("A", act or nn.LeakyReLU(0.01))
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), adn)


def test_a_dropout_of_p0_between_the_norm_and_its_activation_is_passed_and_watched():
    torch.manual_seed(0)
    model = nn.Sequential(adn_block(3, 6, lambda c: nn.InstanceNorm2d(c, affine=True)),
                          adn_block(6, 6, nn.BatchNorm2d)).double()
    x = seeded(2, 3, 8, 8, dtype=torch.float64)
    fused, decisions, _ = _fuses_like_eager(model, x, "module")
    assert [(d.pattern, d.chain) for d in decisions] == [("instance_norm_leaky_relu", ["0.1.N", "0.1.D", "0.1.A"])]
    assert ol.fusion.analyze(model, (x,)).summary()["conv_bn_leaky_relu"] == {"fused": 1, "rejected": 0}
    for m in (model, fused):
        m[0][1].D.p = 0.5  # no longer an identity: the chain runs every module's own forward, with a warning
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    with pytest.warns(RuntimeWarning, match=r"a setting changed: p 0.0 -> 0.5"):
        got = fused(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    kept = adn_block(3, 6, nn.InstanceNorm2d, p=0.1)
    (d,) = [d for d in ol.fusion.analyze(kept, (seeded(2, 3, 8, 8),)).decisions if d.pattern.startswith("instance")]
    assert not d.fused and "goes to `1.D`" in d.reason


class FunctionalPReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.slope = nn.InstanceNorm2d(4), nn.Parameter(torch.full((4,), 0.25))

    def forward(self, x):
        return F.prelu(self.norm(x), self.slope)


def test_a_prelu_after_either_norm_fuses_with_its_weight_trained():
    """MONAI's UNet default: InstanceNorm -> PReLU (one slope per channel, or one), GroupNorm too."""
    torch.manual_seed(0)
    model = nn.Sequential(adn_block(3, 6, lambda c: nn.InstanceNorm3d(c, affine=True), act=nn.PReLU(6)),
                          adn_block(6, 6, lambda c: nn.GroupNorm(2, c), act=nn.PReLU())).double()
    for block in model:  # 3-d convolutions, as MONAI's 3-d nets
        block[0] = nn.Conv3d(block[0].in_channels, block[0].out_channels, 3, padding=1).double()
    fused, _, ratio = _fuses_like_eager(model, seeded(2, 3, 6, 6, 6, dtype=torch.float64), "module")
    plan = ol.fusion.analyze(model, (seeded(2, 3, 6, 6, 6, dtype=torch.float64),))
    assert {d.pattern for d in plan.decisions if d.fused} == {"instance_norm_prelu", "group_norm_prelu"}
    assert ratio < 0.75  # the PReLU's input (the normalised map) is not kept
    (d,) = [d for d in ol.fusion.analyze(FunctionalPReLU(), (seeded(2, 4, 5, 5),)).decisions]
    assert d.pattern == "instance_norm_prelu" and not d.fused and "`F.prelu` with a weight" in d.reason


def test_a_tracked_instance_norm_with_its_prelu_evaluates_from_running_statistics_once_fused():
    """In eval the op normalises with the running statistics and applies the PReLU from its weight: the PReLU
    module itself, rewritten to pass the chain's output on, is not called (it raised here before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                          nn.PReLU(4), nn.Conv2d(4, 4, 1)).double()
    x = seeded(2, 3, 8, 8, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert plan.summary()["instance_norm_prelu"] == {"fused": 1, "rejected": 0}
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)  # training: the buffers move alike
    model.eval(), fused.eval()
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)
