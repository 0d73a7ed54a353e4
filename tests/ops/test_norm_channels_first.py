"""FusedLayerNorm / FusedRMSNorm over dim 1 (``channel_dim=1``): timm's LayerNorm2d / RmsNorm2d, a channels-first
ConvNeXt LayerNorm, against the permute -> norm -> permute they compute."""

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab import ops
from opsnn_lab.bench import activation_bytes
from opsnn_lab.testing import assert_close_dtype, assert_within_eager_error, seeded

C = 13  # odd channel count


class LayerNorm2d(nn.LayerNorm):
    """timm's form: permute to channels-last, F.layer_norm over the last dim, permute back."""

    def forward(self, x):
        x = x.movedim(1, -1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).movedim(-1, 1)


class RmsNorm2d(nn.Module):
    """An RMSNorm over the channels, written out (MobileNetV5's form)."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(c)), eps

    def forward(self, x):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        v = wide.pow(2).mean(1, keepdim=True)
        return (wide * torch.rsqrt(v + self.eps)).to(x.dtype) * self.weight.view(1, -1, *([1] * (x.dim() - 2)))


def _pair(kind, dtype=torch.float64):
    torch.manual_seed(0)
    eager = LayerNorm2d(C, eps=1e-6) if kind == "layer" else RmsNorm2d(C)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(seeded(*p.shape, seed=3, scale=0.5) + 1.0)
    eager = eager.to(dtype)
    cls = ops.FusedLayerNorm if kind == "layer" else ops.FusedRMSNorm
    fused = cls(eager.weight, getattr(eager, "bias", None), eager.eps, channel_dim=1)
    return eager, fused


def _grads(module, x, g):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    params = list(module.parameters())
    return y, torch.autograd.grad(y, [x, *params], g)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("shape", [(2, C, 5), (2, C, 5, 7), (1, C, 3, 4, 5)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "non_contiguous"])
def test_float64_output_layout_and_every_gradient_match_the_module(kind, shape, layout):
    eager, fused = _pair(kind)
    x = seeded(*shape, seed=1, dtype=torch.float64)
    if layout == "channels_last":
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    elif layout == "non_contiguous":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    g = seeded(*shape, seed=2, dtype=torch.float64)
    y_e, grads_e = _grads(eager, x, g)
    y_f, grads_f = _grads(fused, x, g)
    torch.testing.assert_close(y_f, y_e, atol=1e-12, rtol=1e-12)
    if kind == "layer":
        assert y_f.stride() == y_e.stride()  # channels-last strides, as the module's permute back gives
    for a, b in zip(grads_f, grads_e):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_eager_error_vs_float64(kind, dtype):
    eager, fused = _pair(kind, dtype)
    ref, _ = _pair(kind, torch.float64)
    x, g = seeded(3, C, 6, 5, seed=4, dtype=dtype), seeded(3, C, 6, 5, seed=5, dtype=dtype)
    y_r, grads_r = _grads(ref, x.double(), g.double())
    y_e, grads_e = _grads(eager, x, g)
    y_f, grads_f = _grads(fused, x, g)
    assert y_f.dtype == dtype
    assert_within_eager_error(y_f, y_e, y_r, name="output")
    for name, a, b, r in zip(["x", "weight", "bias"], grads_f, grads_e, grads_r):
        assert_within_eager_error(a, b, r, name=f"grad {name}")


def test_saves_its_output_which_the_next_conv_shares():
    # LayerNorm2d -> 1x1 conv (ConvNeXt's channels-first MLP, a downsampling conv): the conv saves the norm's output
    # anyway; eager's norm saves its input, mean and rstd as well, the fused one rstd per position beside it
    eager, fused = _pair("layer", torch.float32)
    conv = nn.Conv2d(C, 8, 1)
    x = seeded(4, C, 16, 16, seed=6).requires_grad_(True)
    eager_bytes = activation_bytes(lambda: conv(eager(x)))
    fused_bytes = activation_bytes(lambda: conv(fused(x)))
    per_map = x.numel() * 4
    assert eager_bytes - fused_bytes == per_map + 4 * 16 * 16 * 4  # the input and the fp32 mean per position


def test_empty_batch_and_eval_without_gradients():
    eager, fused = _pair("layer")
    x = seeded(0, C, 3, 3, seed=7, dtype=torch.float64)
    assert fused(x).shape == x.shape
    with torch.no_grad():
        y = seeded(2, C, 3, 3, seed=8, dtype=torch.float64)
        torch.testing.assert_close(fused.eval()(y), eager.eval()(y))


def test_pickles_and_keeps_the_state_dict_keys():
    eager, fused = _pair("layer")
    again = pickle.loads(pickle.dumps(fused))
    assert again.channel_dim == 1 and "channel_dim=1" in repr(again)
    assert set(fused.state_dict()) == {"weight", "bias"}
    x = seeded(2, C, 4, 4, seed=9, dtype=torch.float64)
    torch.testing.assert_close(again(x), eager(x))


def test_bad_arguments_name_the_argument():
    w = nn.Parameter(torch.ones(C))
    with pytest.raises(ValueError, match="channel_dim"):
        ops.FusedLayerNorm(w, channel_dim=2)
    with pytest.raises(ValueError, match="channel_dim"):
        ops.FusedLayerNorm(nn.Parameter(torch.ones(2, C)), channel_dim=1)
    with pytest.raises(ValueError, match="channel_dim"):
        ops.FusedAddLayerNorm(w, channel_dim=1)
    fused = ops.FusedLayerNorm(w, channel_dim=1)
    with pytest.raises(ValueError, match="x must have 13 channels"):
        fused(torch.zeros(2, C + 1, 3, 3))
    with pytest.raises(ValueError, match="x"):
        fused(torch.zeros(C))


def test_under_autocast_the_channels_first_norm_keeps_its_dtype():
    eager, fused = _pair("layer", torch.float32)
    x = seeded(2, C, 4, 4, seed=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_e, y_f = eager(x), fused(x)
    assert y_f.dtype == y_e.dtype
    assert_close_dtype(y_f, y_e)
