"""Norms over the channels of an (N, C, *) map fuse as layer_norm / rms_norm rows: timm's LayerNorm2d (permute,
F.layer_norm, permute back) and Hugging Face ConvNeXt's channels-first LayerNorm (mean over dim 1 written out) in a
ConvNeXt-style model, found by what they compute; the model trains as eager, the plan's saving is the measured one;
the residual add before such a norm is declined with the reason; and a LayerNorm reading another norm's output at
init (its input already centred, where an RMSNorm gives the same numbers) is taken for the LayerNorm it is."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from opsnn_lab.testing import seeded


class LayerNorm2d(nn.LayerNorm):  # timm's
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ChannelsFirstLayerNorm(nn.Module):  # Hugging Face ConvNeXt's data_format="channels_first" branch
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Block(nn.Module):  # ConvNeXt's block with its MLP as 1x1 convs (timm's atto..nano, conv_mlp=True)
    def __init__(self, c, norm):
        super().__init__()
        self.dw, self.norm = nn.Conv2d(c, c, 7, padding=3, groups=c), norm(c)
        self.fc1, self.fc2 = nn.Conv2d(c, 4 * c, 1), nn.Conv2d(4 * c, c, 1)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(self.dw(x)))))


class Net(nn.Module):
    def __init__(self, norm, c=8):
        super().__init__()
        self.stem, self.stem_norm = nn.Conv2d(3, c, 4, 4), norm(c)
        self.block = Block(c, norm)
        self.down_norm, self.down = norm(c), nn.Conv2d(c, 2 * c, 2, 2)  # the add before down_norm is visible
        self.head = nn.Linear(2 * c, 5)

    def forward(self, x):
        x = self.block(self.stem_norm(self.stem(x)))
        return self.head(self.down(self.down_norm(x)).mean((2, 3)))


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():  # weights and biases off their init, so every gradient is tested for real
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(seeded(*p.shape, seed=len(name), dtype=p.dtype, scale=0.3))
    return model


def _grads(model, x):
    out = model(x)
    return out, torch.autograd.grad(out.sin().sum(), list(model.parameters()))


def _fuses_like_eager(model, x):
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    norms = [d for d in plan.decisions if d.pattern == "layer_norm"]
    (out_a, grads_a), (out_b, grads_b) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    eager = activation_bytes(lambda: model(x).sum(), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(x).sum(), exclude=tuple(fused.parameters()))
    assert plan.saved_bytes == eager - ours > 0
    return plan, norms


def test_timm_layer_norm_2d_fuses_where_a_conv_keeps_its_output_and_trains_as_eager():
    torch.manual_seed(0)
    model = _perturbed(Net(LayerNorm2d).double())
    plan, norms = _fuses_like_eager(model, seeded(2, 3, 32, 32, dtype=torch.float64))
    fused = {m for d in norms if d.fused for m in d.modules}
    assert {"stem_norm", "block.norm", "down_norm"} <= fused, plan.summary()
    assert all("FusedLayerNorm" in d.reason for d in norms if d.fused)
    (add,) = [d for d in plan.decisions if d.pattern == "add_layer_norm"]
    assert not add.fused and "over the channels of an (N, C, *) input" in add.reason


def test_hugging_face_convnext_channels_first_layer_norm_fuses_too():
    torch.manual_seed(0)
    model = _perturbed(Net(ChannelsFirstLayerNorm).double())
    plan, norms = _fuses_like_eager(model, seeded(2, 3, 32, 32, dtype=torch.float64))
    assert {"stem_norm", "block.norm", "down_norm"} <= {m for d in norms if d.fused for m in d.modules}, \
        plan.summary()


class TwoNorms(nn.Module):
    """A bias-free LayerNorm2d reading another's output: at init its input has zero mean over the channels, where
    RMSNorm computes the same numbers; taken for an RMSNorm, it would train wrong once that mean moves."""

    def __init__(self, c=6):
        super().__init__()
        self.conv, self.a, self.b = nn.Conv2d(3, c, 1), LayerNorm2d(c), LayerNorm2d(c, bias=False)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        return self.out(self.b(self.a(self.conv(x))))


def test_a_layer_norm_on_a_centred_input_is_taken_for_a_layer_norm():
    torch.manual_seed(0)
    model = TwoNorms().double()
    x = seeded(2, 3, 5, 5, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    (b,) = [d for d in plan.decisions if d.modules == ["b"]]
    assert b.pattern == "layer_norm" and b.fused and "FusedLayerNorm" in b.reason, plan.summary()
    with torch.no_grad():  # the first norm's output no longer centred: an RMSNorm would now differ
        model.a.bias.add_(1.5)
        fused.get_parameter("a.bias").add_(1.5)
    (out_a, grads_a), (out_b, grads_b) = _grads(model, x), _grads(fused, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
