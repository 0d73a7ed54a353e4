"""Conv -> BN -> act chains of 1-d and 3-d modules in models: a temporal CNN (Conv1d -> BatchNorm1d -> ReLU ->
MaxPool1d), a Conformer's convolution module (depthwise Conv1d -> BatchNorm1d -> SiLU on transposed frames), a video
ResNet block (Conv3d -> BatchNorm3d -> ReLU) and Hugging Face's Wav2Vec2-Conformer. The plan fuses each chain
under its ``conv_bn_<act>`` name, says why where it does not, and the fused model trains as eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.testing import eager_without_dropout


class TemporalCNN(nn.Module):
    """A 1-d CNN over a sequence of features (keyword spotting, time series)."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(3, c, 5, padding=2), nn.BatchNorm1d(c), nn.ReLU(), nn.MaxPool1d(3, 2, 1))
        self.block = nn.Sequential(nn.Conv1d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm1d(c),
                                   nn.Hardswish())
        self.tail = nn.Sequential(nn.Conv1d(c, c, 3, padding=1), nn.BatchNorm1d(c), nn.Tanh())  # not fusable
        self.head = nn.Linear(c, 4)

    def forward(self, x):
        return self.head(self.tail(self.block(self.stem(x))).mean(-1))


class ConformerConv(nn.Module):
    """A Conformer block's convolution module on (batch, frames, channels)."""

    def __init__(self, d=16, k=7):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pointwise1 = nn.Conv1d(d, 2 * d, 1)
        self.depthwise = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.bn = nn.BatchNorm1d(d)
        self.act = nn.SiLU()
        self.pointwise2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        h = nn.functional.glu(self.pointwise1(self.norm(x).transpose(1, 2)), dim=1)
        return x + self.pointwise2(self.act(self.bn(self.depthwise(h)))).transpose(1, 2)


class VideoBlock(nn.Module):
    """A video ResNet's stem and basic block (R3D)."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, c, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(c),
                                  nn.ReLU(inplace=True))
        self.conv1 = nn.Sequential(nn.Conv3d(c, c, 3, padding=1, bias=False), nn.BatchNorm3d(c), nn.ReLU(inplace=True))
        self.conv2 = nn.Sequential(nn.Conv3d(c, c, 3, padding=1, bias=False), nn.BatchNorm3d(c))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.stem(x)
        return self.relu(x + self.conv2(self.conv1(x)))


class VNetBlock(nn.Module):
    """A volume segmentation net's block (VNet: Conv3d -> BatchNorm3d -> ELU) and a YOLOv4-style Conv -> BN -> Mish."""

    def __init__(self, c=6):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv3d(1, c, 5, padding=2), nn.BatchNorm3d(c), nn.ELU())
        self.mish = nn.Sequential(nn.Conv2d(c * 4, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.Mish())

    def forward(self, x):
        h = self.conv(x)
        return self.mish(h.flatten(1, 2))


def _steps(model, x, steps=2):
    """Two training steps' outputs, every gradient (summed over the steps) and every buffer after them."""
    model.zero_grad(set_to_none=True)
    outs = []
    for _ in range(steps):
        out = model(x)
        out.sin().sum().backward()
        outs.append(out.detach())
    return outs, {n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers())


def _assert_trains_as_eager(model, fused, x):
    (oa, ga, ba), (ob, gb, bb) = _steps(model, x), _steps(fused, x)
    for a, b in zip(oa, ob):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert ga.keys() == gb.keys() and ba.keys() == bb.keys()
    for key in ga:
        torch.testing.assert_close(gb[key], ga[key], rtol=1e-10, atol=1e-12, msg=key)
    for key in ba:
        torch.testing.assert_close(bb[key], ba[key], rtol=1e-12, atol=1e-12, msg=key)
    model.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)


CASES = {
    "temporal": (TemporalCNN, (4, 3, 33), {"stem.0": "conv_bn_relu_maxpool", "block.0": "conv_bn_hardswish"}),
    "conformer": (ConformerConv, (2, 19, 16), {"depthwise": "conv_bn_silu"}),
    "video": (VideoBlock, (2, 3, 4, 16, 16), {"stem.0": "conv_bn_relu", "conv1.0": "conv_bn_relu"}),
    "elu_mish": (VNetBlock, (2, 1, 4, 7, 7), {"conv.0": "conv_bn_elu", "mish.0": "conv_bn_mish"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_1d_and_3d_chains_fuse_and_train_as_eager(case):
    build, shape, want = CASES[case]
    torch.manual_seed(0)
    model = build().double().train()
    x = torch.randn(*shape, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    got = {d.modules[0]: d.pattern for d in plan.decisions if d.fused and d.pattern.startswith("conv_bn_")}
    assert got == want, plan.decisions
    _assert_trains_as_eager(model, fused, x)


def test_the_plan_says_why_a_chain_is_not_fused():
    torch.manual_seed(0)
    model = TemporalCNN().train()
    _, plan = ol.fusion.fuse(model, (torch.randn(2, 3, 16),))
    tail = next(d for d in plan.decisions if d.modules[:1] == ["tail.0"])
    assert not tail.fused and "tanh" in tail.reason
    video = VideoBlock().train()
    _, plan = ol.fusion.fuse(video, (torch.randn(1, 3, 2, 8, 8),))
    conv2 = next(d for d in plan.decisions if d.modules[:1] == ["conv2.0"])
    assert not conv2.fused and "conv2.1" in conv2.reason  # its BatchNorm's output goes to the residual add


class ConvFeedForward(nn.Module):
    """A speech model's convolutional feed-forward on (batch, frames, channels): FastSpeech 2's with ReLU, Whisper's
    stem with GELU."""

    def __init__(self, act, d=16, hidden=48):
        super().__init__()
        self.act = act
        self.conv1, self.drop, self.conv2 = nn.Conv1d(d, hidden, 3, padding=1), nn.Dropout(0.0), nn.Conv1d(hidden, d, 1)

    def forward(self, x):
        h = self.act(self.conv1(x.transpose(1, 2)))
        return x + self.conv2(self.drop(h)).transpose(1, 2)


def test_a_conv1d_feed_forward_fuses_where_it_saves_and_trains_as_eager():
    """GELU keeps its input for backward, and the next conv the GELU's output: the fused op drops the second. A ReLU
    keeps its output, which the next conv keeps anyway: nothing to save, declined with that reason."""
    torch.manual_seed(0)
    model = ConvFeedForward(nn.functional.gelu).double().train()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    fused, plan = ol.fusion.fuse(model, (x,))
    assert [(d.pattern, d.route) for d in plan.decisions if d.fused] == [("conv_gelu_dropout_conv", "fx:<model>")]
    _assert_trains_as_eager(model, fused, x)
    f32 = ConvFeedForward(nn.functional.gelu).train()
    fused32, _ = ol.fusion.fuse(f32, (x.float(),))
    saved = activation_bytes(lambda: f32(x.float())) - activation_bytes(lambda: fused32(x.float()))
    assert saved == 2 * 48 * 23 * 4, saved  # the GELU's output (conv2's input)
    _, plan = ol.fusion.fuse(ConvFeedForward(torch.relu).train(), (x.float(),))
    (relu,) = plan.decisions
    assert relu.pattern == "conv_relu_dropout_conv" and not relu.fused and "saves 0 of its" in relu.reason


def test_fused_conformer_convolution_drops_the_batch_norm_output():
    """Eager keeps the BatchNorm's output for the SiLU's backward; the fused op recomputes it. (The activation's
    output stays: the pointwise conv after it keeps it as its input. A ReLU chain whose output the next conv
    reads saves no more than eager: the op saves what eager's ReLU and next conv already share.)"""
    torch.manual_seed(0)
    model = ConformerConv(16).train()
    x = torch.randn(2, 40, 16)
    fused, _ = ol.fusion.fuse(model, (x,), patterns=["conv_bn_relu"])  # the conv chains' family alone
    saved = activation_bytes(lambda: model(x)) - activation_bytes(lambda: fused(x))
    bn_output = 2 * 16 * 40 * 4
    assert bn_output <= saved <= bn_output + 2 * 16 * 4, saved  # and at most a per-channel pair of statistics


def test_wav2vec2_conformer_fuses_its_convolution_modules():
    T = pytest.importorskip("transformers")
    cfg = T.Wav2Vec2ConformerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32,
                                    conv_depthwise_kernel_size=7, position_embeddings_type="relative",
                                    mask_time_prob=0.0)
    eager_without_dropout(cfg)  # the conv module's dropout too (conformer_conv_dropout)
    torch.manual_seed(0)
    model = T.Wav2Vec2ConformerForCTC(cfg).double().train()
    inputs = {"input_values": torch.randn(2, 1600, dtype=torch.float64), "labels": torch.randint(1, 30, (2, 3))}
    fused, plan = ol.fusion.fuse(model, inputs)
    convs = [d.modules[0] for d in plan.decisions if d.fused and d.pattern.startswith("conv_bn_")]
    assert convs == [f"wav2vec2_conformer.encoder.layers.{i}.conv_module.depthwise_conv" for i in range(2)], convs
    grads = []
    for m in (model, fused):
        m.zero_grad(set_to_none=True)
        m(**inputs).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key, g in grads[0].items():
        torch.testing.assert_close(grads[1][key], g, rtol=1e-9, atol=1e-12, msg=key)


class FrozenBatchNorm2d(nn.Module):
    """Detection backbones' batch norm (torchvision's, timm's): fixed statistics and affine, as buffers."""

    def __init__(self, c):
        super().__init__()
        for name, value in (("weight", torch.ones(c)), ("bias", torch.zeros(c)), ("running_mean", torch.zeros(c)),
                            ("running_var", torch.ones(c))):
            self.register_buffer(name, value)

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        return x * scale[:, None, None] + (self.bias - self.running_mean * scale)[:, None, None]


class ShiftedBatchNorm2d(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) + 1.0


def test_batch_norms_the_op_does_not_compute_are_named_in_the_plan():
    """A SyncBatchNorm (``convert_sync_batchnorm`` for DDP), a frozen batch norm (a detection backbone's) and a
    BatchNorm2d subclass computing something else were no candidate at all: the plan said nothing of the chains."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
                          nn.Conv2d(8, 8, 3, padding=1), FrozenBatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 1), nn.Identity(), nn.ReLU())
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).train()
    model[7] = ShiftedBatchNorm2d(8)  # after the conversion, which would take it too
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    fused, plan = ol.fusion.fuse(model, (x,))
    reasons = {d.modules[0]: d.reason for d in plan.decisions if d.pattern.startswith("conv_bn")}
    # each names the conv and its norm, a frozen one's steps (run inside its own forward) included
    assert sorted(d.modules for d in plan.decisions if d.pattern.startswith("conv_bn")) == [
        ["0", "1"], ["3", "4"], ["6", "7"]]
    assert not any(d.fused for d in plan.decisions if d.pattern.startswith("conv_bn"))
    assert "`1` is a SyncBatchNorm" in reasons["0"] and "all-reduced across ranks" in reasons["0"]
    assert "`4` is a FrozenBatchNorm2d" in reasons["3"] and "save nothing" in reasons["3"]
    assert "bn must be BatchNorm2d" in reasons["6"] and "got ShiftedBatchNorm2d" in reasons["6"]
    torch.testing.assert_close(fused(x), model(x))


class StandardisedConv1d(nn.Conv1d):
    """Weight standardisation in the conv's own forward: the chain is declined, and said."""

    def forward(self, x):
        w = self.weight - self.weight.mean((1, 2), keepdim=True)
        return F.conv1d(x, w, self.bias, self.stride, self.padding)


class StandardisedConv3d(nn.Conv3d):
    def forward(self, x):
        w = self.weight - self.weight.mean((1, 2, 3, 4), keepdim=True)
        return F.conv3d(x, w, self.bias, self.stride, self.padding)


@pytest.mark.parametrize("conv, bn, shape", [(StandardisedConv1d(3, 8, 3, padding=1), nn.BatchNorm1d(8), (2, 3, 10)),
                                             (StandardisedConv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8),
                                              (2, 3, 4, 5, 5))])
def test_a_1d_or_3d_conv_with_a_forward_of_its_own_is_a_declined_candidate(conv, bn, shape):
    model = nn.Sequential(conv, bn, nn.SiLU()).train()
    x = torch.randn(*shape)
    fused, plan = ol.fusion.fuse(model, (x,))
    (d,) = plan.decisions
    assert d.modules == ["0", "1"] and not d.fused
    assert f"`0` is a {type(conv).__name__} whose own forward does more than a convolution" in d.reason
    torch.testing.assert_close(fused(x), model(x))
