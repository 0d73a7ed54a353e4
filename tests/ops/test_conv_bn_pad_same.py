"""FusedConvBNAct(pad_same=True): a Conv2d subclass whose own forward pads TensorFlow's 'same' way for each input
size (timm's ``Conv2dSame`` in its ``tf_*`` models, EfficientNet-PyTorch's dynamic-padding conv), then BN and an
activation, against eager: outputs, every gradient, statistics, odd and even sizes, strides, dilation, depthwise,
half precision, and the settings it turns down."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.measuring import activation_bytes
from opsnn_lab.ops._conv_bn_args import same_pads
from opsnn_lab.ops.conv_bn_relu import FusedConvBNAct, FusedConvBNReLU
from opsnn_lab.testing import TOLERANCES, assert_within_eager_error, seeded


class Conv2dSame(nn.Conv2d):
    """'same' padding for any input size, as TensorFlow computes it (timm's pad_same, written out here)."""

    def forward(self, x):
        pads = []
        for n, k, s, d in zip(x.shape[-2:], self.kernel_size, self.stride, self.dilation):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        x = F.pad(x, [pads[1][0], pads[1][1], pads[0][0], pads[0][1]])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


# name: (Cin, Cout, kernel, stride, dilation, groups, act)
CASES = {"s2": (3, 6, 3, 2, 1, 1, nn.SiLU), "s2_k5_depthwise": (6, 6, 5, 2, 1, 6, nn.SiLU),
         "s1_even_kernel": (4, 5, 4, 1, 1, 1, nn.ReLU), "dilated": (3, 4, 3, 1, 2, 1, nn.Hardswish),
         "s3": (2, 4, 3, 3, 1, 1, nn.ReLU6)}


def chain(case):
    cin, cout, k, s, d, g, act = CASES[case]
    torch.manual_seed(0)
    conv, bn = Conv2dSame(cin, cout, k, s, dilation=d, groups=g, bias=False), nn.BatchNorm2d(cout)
    with torch.no_grad():
        bn.weight.uniform_(1.0, 3.0)
        bn.bias.uniform_(-0.5, 0.5)
    return [conv, bn, act()]


def run(module, mods, x):
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(seeded(*out.shape, seed=3, dtype=out.dtype))
    return [out.detach(), x.grad, *(p.grad for m in mods[:2] for p in m.parameters()), *mods[1].buffers()]


def pair(case, dtype, train=True):
    mods = chain(case)
    em, fm = ([copy.deepcopy(m).to(dtype) for m in mods] for _ in range(2))
    cls = FusedConvBNReLU if type(fm[2]) is nn.ReLU else FusedConvBNAct
    return (nn.Sequential(*em).train(train), em), (cls.from_modules(*fm, pad_same=True).train(train), fm)


@pytest.mark.parametrize("size", [(9, 7), (8, 8), (1, 5)], ids=["odd", "even", "thin"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager(case, train, size):
    for dtype in (torch.float64, torch.float32):
        (eager, em), (fused, fm) = pair(case, dtype, train)
        x = seeded(2, CASES[case][0], *size, seed=1, dtype=dtype)
        want, got = run(eager, em, x), run(fused, fm, x)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, i
            scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
            assert (g.double() - w.double()).abs().max().item() <= TOLERANCES[dtype][0] * scale, (case, dtype, i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_eager_error(dtype):
    (ref, rm), _ = pair("s2", torch.float64)
    (eager, em), (fused, fm) = pair("s2", dtype)
    x = seeded(2, 3, 11, 10, seed=2)
    want = run(ref, rm, x.double())
    for f, e, r in zip(run(fused, fm, x.to(dtype))[:-1], run(eager, em, x.to(dtype))[:-1], want[:-1]):
        assert_within_eager_error(f, e.to(f.dtype), r)


def test_saves_the_padded_input_as_eager_does_and_drops_the_batch_norm_output():
    (eager, _), (fused, _) = pair("s2", torch.float32)
    x = seeded(2, 3, 32, 32, seed=4)
    # eager: the padded input (the conv's), the conv output (BN's) and the BN output (SiLU's); fused: the first two
    ratio = activation_bytes(lambda: fused(x)) / activation_bytes(lambda: eager(x))
    padded, out = 3 * 33 * 33, 6 * 16 * 16
    assert ratio == pytest.approx((padded + out) / (padded + 2 * out), abs=0.01), ratio


def test_same_pads_follow_the_output_size_rule():
    for n, k, s, d in [(9, 3, 2, 1), (8, 3, 2, 1), (7, 5, 1, 2), (1, 3, 2, 1), (10, 1, 3, 1)]:
        left, right, _, _ = same_pads((1, n), (1, k), (1, s), (1, d))
        out = (n + left + right - d * (k - 1) - 1) // s + 1
        assert out == math.ceil(n / s) and 0 <= right - left <= 1, (n, k, s, d)


def test_settings_it_turns_down_name_the_argument():
    bn, act = nn.BatchNorm2d(4), nn.SiLU()
    ok, why = FusedConvBNAct.supports(Conv2dSame(3, 4, 3, padding=1), bn, act, pad_same=True)
    assert not ok and "conv.padding=(1, 1) with pad_same=True" in why
    ok, why = FusedConvBNAct.supports(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), act, pad_same=True)
    assert not ok and "conv must be Conv2d (pad_same=True)" in why
    ok, why = FusedConvBNAct.supports(Conv2dSame(3, 4, 3), bn, act)  # its own forward: pad_same must say so
    assert not ok and "Conv2dSame" in why
    with pytest.raises(TypeError, match="pad_same must be bool"):
        FusedConvBNAct.from_modules(Conv2dSame(3, 4, 3), bn, act, pad_same="yes")
    assert "pad_same=True" in repr(FusedConvBNAct.from_modules(Conv2dSame(3, 4, 3), bn, act, pad_same=True))


def test_one_value_per_channel_raises_like_eager():
    (eager, _), (fused, _) = pair("s3", torch.float32)
    x = seeded(1, 2, 3, 2)  # 'same' at stride 3: one output value per channel
    for module in (eager, fused):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            module(x)
