"""Convolutions that pad 'same' in their own forward (TensorFlow-ported weights: timm's ``tf_*`` models'
``Conv2dSame``, EfficientNet-PyTorch's convs): the probe finds the ones padding 'same' for every input size, their
Conv -> BN -> act chains fuse (``pad_same``) and train as eager; one padding a fixed amount (computed for one image
size at construction) is looked into and its chain declined with the reason. Before, neither was a candidate: the
plan said nothing of them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.fusion.graph import Probed


class DynamicSame(nn.Conv2d):
    def forward(self, x):
        ih, iw = x.shape[-2:]
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        ph = max((math.ceil(ih / sh) - 1) * sh + (kh - 1) * dh + 1 - ih, 0)
        pw = max((math.ceil(iw / sw) - 1) * sw + (kw - 1) * dw + 1 - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StaticSame(nn.Conv2d):
    """Pads what 'same' needs for ``image`` px, whatever size comes."""

    def __init__(self, *args, image=32, **kwargs):
        super().__init__(*args, **kwargs)
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        ph = max((math.ceil(image / sh) - 1) * sh + kh - image, 0)
        pw = max((math.ceil(image / sw) - 1) * sw + kw - image, 0)
        self.static_padding = nn.ZeroPad2d((pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))

    def forward(self, x):
        return F.conv2d(self.static_padding(x), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(DynamicSame(3, 8, 3, 2, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.dw = nn.Sequential(DynamicSame(8, 8, 5, 2, groups=8, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.static = nn.Sequential(StaticSame(8, 8, 3, 2, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.static(self.dw(self.stem(x))).mean((2, 3)))


def test_dynamic_same_convs_fuse_and_static_ones_are_declined():
    torch.manual_seed(0)
    model = Net().double().train()
    x = torch.randn(2, 3, 33, 31, dtype=torch.float64)  # odd sides: the static conv's padding is not 'same' here
    fused, plan = ol.fusion.fuse(model, (x,))
    conv = {d.modules[0]: d for d in plan.decisions if d.pattern.startswith("conv_bn")}
    assert conv["stem.0"].fused and conv["dw.0"].fused and conv["stem.0"].pattern == "conv_bn_silu"
    static = conv["static.0"]  # the conv ran inside its module's forward: named by that module and its BatchNorm
    assert static.modules == ["static.0", "static.1"]
    assert not static.fused and "`static.0` is a StaticSame whose own forward" in static.reason
    assert model.stem[0] in Probed.same_conv and model.static[0] not in Probed.same_conv
    for _ in range(2):  # two steps: the running statistics move as eager's
        model.zero_grad(), fused.zero_grad()
        want, got = model(x), fused(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        want.sin().sum().backward(), got.sin().sum().backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
    for (name, b), c in zip(model.named_buffers(), fused.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-12, atol=1e-12, msg=name)
    model.eval(), fused.eval()
    y = torch.randn(1, 3, 20, 26, dtype=torch.float64)  # another size: the op pads for it
    torch.testing.assert_close(fused(y), model(y), rtol=1e-12, atol=1e-12)
