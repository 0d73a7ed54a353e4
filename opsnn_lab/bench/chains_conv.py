"""Conv -> BN -> {ReLU6, SiLU, Hardswish} rows of ``python -m opsnn_lab.bench ops`` at MobileNet/EfficientNet widths.

Each activation gets two rows, the two convolutions of an inverted-residual block:

* ``conv_bn_<act>``: the 1x1 expansion (C -> 6C). Eager saves x, the conv output and the BN output; the fused
  op saves x and the conv output: (1 + 6) / (1 + 12) = 0.54 of the chain's bytes.
* ``conv_bn_<act>_dw``: the 3x3 depthwise conv (groups = 6C). Here x is as large as the conv output (stride 1)
  or 4x larger (stride 2). At stride 1 the fused op saves x only and recomputes the depthwise conv's output in
  backward (one pass over x): 1 / (1 + 2) = 0.33 of eager's x, conv output and BN output. At stride 2 it saves
  x and the conv output: (4 + 1) / (4 + 2) = 0.83; ``conv_bn_silu_dw[recompute]`` (``recompute=True``) gives
  4 / 6 = 0.67 for a conv pass over x, the bound: x itself, which the conv's weight gradient needs.

The same op over the other dimensions:

* ``conv1d_bn_silu_dw``: a Conformer convolution module's depthwise Conv1d (kernel 31, stride 1) -> BatchNorm1d ->
  SiLU over the encoder's frames (speech recognition). A 1-d conv's output is saved, not recomputed (its recompute
  costs more than a 2-d one's: ``FusedConvBNAct``'s ``recompute``): x and the conv output, 2 / 3;
  ``conv1d_bn_silu_dw[recompute]`` saves x alone, 1 / 3, for the recomputed conv.
* ``conv3d_bn_relu``: a video ResNet's (R3D / MC3 / R(2+1)D) 3x3x3 convolution over 4 frames of the first stage.
  Eager saves x, the conv output and the ReLU's output, the fused op x and the conv output: 2 / 3.
* ``conv_bn_prelu``: a face-recognition backbone's (MobileFaceNet's, IResNet's) 3x3 conv -> BN -> PReLU (one slope
  per channel) at the stem's width over the 56 x 56 stage. Eager saves x, the conv output and the BN output (the
  PReLU's input); the fused op x and the conv output: 2 / 3, and it trains the PReLU's weight.

And the channels-first MLP (timm's ``ConvMlp`` / ``Mlp(use_conv=True)``: FocalNet, PoolFormer, RDNet):

* ``conv_gelu_conv``: 1x1 conv C -> 4C, GELU, 1x1 conv 4C -> C. Eager saves x, the pre-activation and the GELU's
  output; the fused op (``FusedConvActDropoutConv``) x and the pre-activation: (1 + 4) / (1 + 4 + 4) = 0.56.

And a diffusion UNet's ResNet block:

* ``group_norm_silu+conv``: GroupNorm (32 groups) -> SiLU -> the 3x3 conv that reads it, at the stem's width over
  the 56 x 56 stage. Eager saves x, the normalised tensor and the SiLU's output (the conv's input); the fused op
  (``FusedGroupNormAct``) x and the conv's input, plus 2 statistics per (sample, group): 2 / 3 of the chain.

And a 3-d segmentation UNet's block (nnU-Net's, MONAI's):

* ``instance_norm_leaky_relu+conv3d``: InstanceNorm3d (affine) -> LeakyReLU (not in place) -> the 3x3x3 conv that
  reads it, at the stem's width over a 14^3 volume at FULL. Eager saves x, the normalised tensor (the LeakyReLU's
  input) and the conv's input, plus its weight repeated per sample; the fused op (``FusedInstanceNormAct``) x and the
  conv's input, plus 2 statistics per (sample, channel): 2 / 3. (An in-place LeakyReLU keeps its output instead,
  which the conv keeps anyway: eager then saves what the fused op does, and ``ol.fusion`` declines it.)

Widths from the bench's shape table: ``FULL`` (batch 8, stem 224) gives MobileNetV2's 56 x 56 stage
(24 -> 144 channels); ``QUICK`` a 8 x 8 plane with 4 -> 24 channels. ReLU6 and Hardswish rows use
MobileNetV2/V3's in-place activations, as torchvision builds them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CONV_CHAINS", "CONV_BUILDERS"]

_ACTS = {"relu6": lambda: nn.ReLU6(inplace=True), "silu": lambda: nn.SiLU(inplace=True),
         "hardswish": lambda: nn.Hardswish(inplace=True)}
# (activation, depthwise stride): MobileNetV2 ReLU6 stride 1, EfficientNet SiLU stride 2, MobileNetV3 Hardswish 1
_ROWS = (("relu6", 1), ("silu", 2), ("hardswish", 1))
CONV_CHAINS = (*(name for act, _ in _ROWS for name in (f"conv_bn_{act}", f"conv_bn_{act}_dw")),
               "conv_bn_silu_dw[recompute]", "conv1d_bn_silu_dw", "conv1d_bn_silu_dw[recompute]",
               "conv3d_bn_relu", "conv_bn_prelu", "conv_gelu_conv",
               "group_norm_silu+conv", "instance_norm_leaky_relu+conv3d")


def _widths(s: dict) -> tuple[int, int, int]:
    """(input channels, expanded channels, plane side) scaled from the bench's shape table."""
    cin = max(4, s["channels"] * 3 // 8)
    return cin, 6 * cin, s["image"] // 4


def _chain(s, device, dtype, act: str, depthwise: bool, stride: int, recompute: bool | None = None):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    cin, cexp, side = _widths(s)
    if depthwise:
        conv = nn.Conv2d(cexp, cexp, 3, stride, 1, groups=cexp, bias=False)
        x = torch.randn(s["batch"], cexp, side, side, device=device, dtype=dtype, requires_grad=True)
    else:
        conv = nn.Conv2d(cin, cexp, 1, bias=False)
        x = torch.randn(s["batch"], cin, side, side, device=device, dtype=dtype, requires_grad=True)
    bn, module = nn.BatchNorm2d(cexp), _ACTS[act]()
    eager = nn.Sequential(conv, bn, module).to(device, dtype)
    fused = ops.FusedConvBNAct.from_modules(conv, bn, module, recompute=recompute)
    what = f"depthwise 3x3 s{stride}, {cexp} ch" if depthwise else f"1x1 {cin} -> {cexp} ch"
    name = f"conv_bn_{act}" + ("_dw" if depthwise else "") + ("[recompute]" if recompute else "")
    return Chain(name, eager, fused, (x,), note=f"{what}, {side}x{side}")


def _builder(act: str, depthwise: bool, stride: int, recompute: bool | None = None):
    return lambda s, device, dtype: _chain(s, device, dtype, act, depthwise, stride, recompute)


CONV_BUILDERS = {name: _builder(act, name.endswith("_dw"), stride)
                 for act, stride in _ROWS for name in (f"conv_bn_{act}", f"conv_bn_{act}_dw")}
CONV_BUILDERS["conv_bn_silu_dw[recompute]"] = _builder("silu", True, 2, recompute=True)


def _conformer_chain(s, device, dtype, recompute: bool | None = None):
    """Conformer's depthwise conv: 4x the stem's width (256 at FULL, Conformer-M) over 4x the image side in frames
    (896: 9 s of speech after the 4x subsampling)."""
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    c, frames = 4 * s["channels"], 4 * s["image"]
    conv, bn, act = nn.Conv1d(c, c, 31, padding=15, groups=c, bias=False), nn.BatchNorm1d(c), nn.SiLU()
    eager = nn.Sequential(conv, bn, act).to(device, dtype)
    x = torch.randn(s["batch"], c, frames, device=device, dtype=dtype, requires_grad=True)
    name = "conv1d_bn_silu_dw" + ("[recompute]" if recompute else "")
    return Chain(name, eager, ops.FusedConvBNAct.from_modules(conv, bn, act, recompute=recompute), (x,),
                 note=f"depthwise k31, {c} ch, {frames} frames")


def _video_chain(s, device, dtype):
    """A video ResNet's first-stage 3x3x3 conv: the stem's width over 4 frames of the 56 x 56 stage, a quarter of
    the batch (2 clips at FULL)."""
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    c, side, clips = s["channels"], s["image"] // 4, max(1, s["batch"] // 4)
    conv, bn, act = nn.Conv3d(c, c, 3, padding=1, bias=False), nn.BatchNorm3d(c), nn.ReLU(inplace=True)
    eager = nn.Sequential(conv, bn, act).to(device, dtype)
    x = torch.randn(clips, c, 4, side, side, device=device, dtype=dtype, requires_grad=True)
    return Chain("conv3d_bn_relu", eager, ops.FusedConvBNAct.from_modules(conv, bn, act), (x,),
                 note=f"3x3x3 {c} ch, 4x{side}x{side}")


CONV_BUILDERS["conv1d_bn_silu_dw"] = _conformer_chain
CONV_BUILDERS["conv1d_bn_silu_dw[recompute]"] = lambda s, device, dtype: _conformer_chain(s, device, dtype, True)
CONV_BUILDERS["conv3d_bn_relu"] = _video_chain


def _prelu_chain(s, device, dtype):
    """A face-recognition backbone's 3x3 conv -> BN -> PReLU (per channel), the stem's width over image / 4."""
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    c, side = s["channels"], s["image"] // 4
    conv, bn, act = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.PReLU(c)
    eager = nn.Sequential(conv, bn, act).to(device, dtype)
    x = torch.randn(s["batch"], c, side, side, device=device, dtype=dtype, requires_grad=True)
    return Chain("conv_bn_prelu", eager, ops.FusedConvBNAct.from_modules(conv, bn, act), (x,),
                 note=f"3x3 {c} ch, {side}x{side}")


CONV_BUILDERS["conv_bn_prelu"] = _prelu_chain


def _conv_mlp_chain(s, device, dtype):
    """A FocalNet / PoolFormer stage's MLP: the stem's width (64 at FULL) over the 56 x 56 stage, widened 4x."""
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    c, side = s["channels"], s["image"] // 4
    fc1, act, fc2 = nn.Conv2d(c, 4 * c, 1), nn.GELU(), nn.Conv2d(4 * c, c, 1)
    eager = nn.Sequential(fc1, act, fc2).to(device, dtype)
    x = torch.randn(s["batch"], c, side, side, device=device, dtype=dtype, requires_grad=True)
    fused = ops.FusedConvActDropoutConv.from_modules(fc1, act, None, fc2)
    return Chain("conv_gelu_conv", eager, fused, (x,), note=f"1x1 {c} -> {4 * c} -> {c} ch, {side}x{side}")


CONV_BUILDERS["conv_gelu_conv"] = _conv_mlp_chain


def _group_norm_chain(s, device, dtype):
    """A UNet ResNet block's ``conv1(silu(norm1(x)))``: the stem's width (64 at FULL), 32 groups (diffusers')."""
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    c, side = s["channels"], s["image"] // 4
    groups = min(32, c // 2)
    norm, act, conv = nn.GroupNorm(groups, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1)
    eager = nn.Sequential(norm, act, conv).to(device, dtype)
    fused = nn.Sequential(ops.FusedGroupNormAct.from_modules(norm, act), conv)
    x = torch.randn(s["batch"], c, side, side, device=device, dtype=dtype, requires_grad=True)
    return Chain("group_norm_silu+conv", eager, fused, (x,), note=f"{groups} groups, {c} ch, {side}x{side}")


CONV_BUILDERS["group_norm_silu+conv"] = _group_norm_chain


def _instance_norm_chain(s, device, dtype):
    """A 3-d segmentation UNet's ``conv(leaky_relu(norm(x)))``: the stem's width, a volume of side image / 16."""
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    c, side = s["channels"], max(4, s["image"] // 16)
    norm, act, conv = nn.InstanceNorm3d(c, affine=True), nn.LeakyReLU(0.01), nn.Conv3d(c, c, 3, padding=1)
    eager = nn.Sequential(norm, act, conv).to(device, dtype)
    fused = nn.Sequential(ops.FusedInstanceNormAct.from_modules(norm, act), conv)
    x = torch.randn(s["batch"], c, side, side, side, device=device, dtype=dtype, requires_grad=True)
    return Chain("instance_norm_leaky_relu+conv3d", eager, fused, (x,), note=f"{c} ch, {side}^3")


CONV_BUILDERS["instance_norm_leaky_relu+conv3d"] = _instance_norm_chain
