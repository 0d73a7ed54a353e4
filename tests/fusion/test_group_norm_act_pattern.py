"""The group_norm_<act> row: a diffusion UNet's ResNet block (GroupNorm -> SiLU before each conv, one SiLU module
shared by both: the fx route), a wav2vec2-style encoder layer (GroupNorm -> GELU modules: a module chain) and
timm's GroupNormAct (a GroupNorm applying its activation itself, probed: the module whole) fuse and train as
eager; the plan's saving is the measured one; the refusals say why."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class ResnetBlock(nn.Module):
    def __init__(self, c=16, groups=4, act=None):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1)
        self.nonlinearity = act or nn.SiLU()

    def forward(self, x):
        h = self.conv1(self.nonlinearity(self.norm1(x)))
        return x + self.conv2(self.nonlinearity(self.norm2(h)))


class EncoderLayer(nn.Module):  # wav2vec2's first feature-encoder layer: conv -> GroupNorm -> GELU
    def __init__(self):
        super().__init__()
        self.conv, self.layer_norm, self.activation = nn.Conv1d(1, 8, 10, stride=5), nn.GroupNorm(8, 8), nn.GELU()

    def forward(self, x):
        return self.activation(self.layer_norm(self.conv(x)))


def _grads(model, x):
    out = model(x)
    return out, torch.autograd.grad(out.sin().sum(), list(model.parameters()))


def _fuses_like_eager(model, x, route):
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    decisions = [d for d in plan.decisions if d.pattern.startswith("group_norm_")]
    assert decisions and all(d.fused and d.route.startswith(route) for d in decisions), plan.summary()
    (out_a, grads_a), (out_b, grads_b) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    exclude = tuple(model.parameters())
    eager = activation_bytes(lambda: model(x).sum(), exclude=exclude)
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == eager - ours > 0
    return decisions, ours / eager


def test_a_unet_resnet_block_fuses_both_norms_through_fx():
    torch.manual_seed(0)
    model = nn.Sequential(ResnetBlock(), ResnetBlock()).double()
    decisions, ratio = _fuses_like_eager(model, seeded(2, 16, 12, 12, dtype=torch.float64), "fx")
    assert [d.pattern for d in decisions] == ["group_norm_silu"] * 4
    assert ratio < 0.7  # of every block's 6 saved tensors of the map's size, the two normalised ones go


def test_an_encoder_layer_fuses_as_a_module_chain():
    torch.manual_seed(0)
    decisions, _ = _fuses_like_eager(EncoderLayer().double(), seeded(2, 1, 400, dtype=torch.float64), "module")
    assert [d.pattern for d in decisions] == ["group_norm_gelu"]


class ReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.act = nn.GroupNorm(2, 4), nn.SiLU()

    def forward(self, x):
        y = self.norm(x)
        return self.act(y) + y


def test_refusals_say_why():
    x = seeded(2, 4, 5, 5)
    (d,) = ol.fusion.analyze(ReadTwice(), (x,)).decisions
    assert not d.fused and "the output of `norm` is also read by" in d.reason
    (d,) = [d for d in ol.fusion.analyze(ResnetBlock(4, 2, act=nn.Tanh()), (x,)).decisions[:1]]
    assert not d.fused and "not one activation of" in d.reason
    plain = nn.Sequential(nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 1))
    (d,) = ol.fusion.analyze(plain, (x,)).decisions
    assert d.pattern == "group_norm_act" and not d.fused and "goes to `1`" in d.reason


class GroupNormAct(nn.GroupNorm):  # timm's: a GroupNorm that applies its activation itself (ResNetV2-BiT, RegNet)
    def __init__(self, channels, groups, act=None):
        super().__init__(groups, channels)
        self.drop, self.act = nn.Identity(), act or nn.ReLU(inplace=True)

    def forward(self, x):
        x = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return self.act(self.drop(x))


class ShiftedGroupNormAct(GroupNormAct):
    def forward(self, x):
        return super().forward(x) + 1.0


class PreActBlock(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.conv = norm, nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return x + self.conv(self.norm(x))


def test_a_group_norm_applying_its_own_activation_fuses_whole_and_one_computing_more_is_looked_into():
    torch.manual_seed(0)
    model = nn.Sequential(PreActBlock(GroupNormAct(8, 2, nn.SiLU())), PreActBlock(GroupNormAct(8, 4, nn.GELU())))
    decisions, ratio = _fuses_like_eager(model.double(), seeded(2, 8, 6, 6, dtype=torch.float64), "module")
    assert [(d.pattern, d.modules) for d in decisions] == [("group_norm_silu", ["0.norm"]),
                                                           ("group_norm_gelu", ["1.norm"])]
    # ResNetV2-BiT's: GroupNorm -> ReLU keeps nothing more than the fused op would (the ReLU keeps its output)
    (d,) = [d for d in ol.fusion.analyze(PreActBlock(GroupNormAct(8, 4)), (seeded(2, 8, 6, 6),)).decisions
            if d.pattern.startswith("group_norm")]
    assert d.pattern == "group_norm_relu" and not d.fused and "a ReLU keeps its output" in d.reason
    other = nn.Sequential(PreActBlock(ShiftedGroupNormAct(8, 4, nn.SiLU())))  # not act(group_norm(x))
    plan = ol.fusion.analyze(other, (seeded(2, 8, 6, 6),))
    assert not any(d.pattern.startswith("group_norm") for d in plan.decisions)
