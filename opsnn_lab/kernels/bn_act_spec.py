"""BatchNorm + activation: the activation table, the pool spec and the folded BN scale (shared by both paths)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["Act", "ACTS", "RELU", "PoolSpec", "scale_shift", "slope_view", "slope_args"]

# Names as in torch.nn.functional / Hugging Face ACT2FN; the index is the kernels' ACT constexpr.
ACTS = ("relu", "relu6", "leaky_relu", "silu", "hardswish", "gelu", "gelu_tanh", "mish", "elu")


@dataclass(frozen=True)
class Act:
    """A pointwise activation: ``name`` from :data:`ACTS`, ``negative_slope`` read by ``leaky_relu`` only (``elu``
    is ELU with alpha 1, the one ``ops._activations`` takes)."""

    name: str = "relu"
    negative_slope: float = 0.01

    def __post_init__(self):
        if self.name not in ACTS:
            raise ValueError(f"act must be one of {ACTS}, got {self.name!r}")

    @property
    def code(self) -> int:
        return ACTS.index(self.name)

    @property
    def monotone(self) -> bool:
        """Non-decreasing, so max-pool commutes with it and can run first, on the pre-activation."""
        return self.name in ("relu", "relu6", "elu") or (self.name == "leaky_relu" and self.negative_slope >= 0)

    @property
    def has_dead_zone(self) -> bool:
        """Gradient 0 or 1 decided by the output alone (ReLU, ReLU6): a pool stores a sentinel index where it is
        0 and backward needs no pre-activation."""
        return self.name in ("relu", "relu6")

    def dead(self, out: torch.Tensor) -> torch.Tensor:
        """Where the derivative is 0, from the activation's output (``has_dead_zone`` activations only)."""
        return out <= 0 if self.name == "relu" else (out <= 0) | (out >= 6)

    def forward(self, z: torch.Tensor, inplace: bool) -> torch.Tensor:
        """Eager's own op for the activation (in place on ``z`` when allowed)."""
        n = self.name
        if n == "relu":
            return z.relu_() if inplace else z.relu()
        if n == "relu6":
            return F.hardtanh(z, 0.0, 6.0, inplace=inplace)
        if n == "leaky_relu":
            return F.leaky_relu(z, self.negative_slope, inplace=inplace)
        if n == "silu":
            return F.silu(z, inplace=inplace)
        if n == "hardswish":
            return F.hardswish(z, inplace=inplace)
        if n == "mish":
            return F.mish(z, inplace=inplace)
        if n == "elu":
            return F.elu(z, inplace=inplace)
        return F.gelu(z, approximate="tanh" if n == "gelu_tanh" else "none")

    def backward_(self, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Eager's backward op of the activation at pre-activation ``z``, written over ``z`` (element-wise) where
        the op has a native out= form."""
        aten, n = torch.ops.aten, self.name
        if n == "relu":
            return aten.threshold_backward.grad_input(grad, z, 0, grad_input=z)
        if n == "relu6":
            return aten.hardtanh_backward.grad_input(grad, z, 0.0, 6.0, grad_input=z)
        if n == "leaky_relu":
            return aten.leaky_relu_backward.grad_input(grad, z, self.negative_slope, False, grad_input=z)
        if n == "silu":
            return aten.silu_backward.grad_input(grad, z, grad_input=z)
        if n == "hardswish":
            return aten.hardswish_backward(grad, z)  # its out= overload computes, then copies: slower
        if n == "mish":
            return aten.mish_backward(grad, z)
        if n == "elu":  # alpha 1, scale 1, input scale 1, from the input (not the result)
            return aten.elu_backward.grad_input(grad, 1.0, 1, 1, False, z, grad_input=z)
        approx = "tanh" if n == "gelu_tanh" else "none"
        return aten.gelu_backward.grad_input(grad, z, approximate=approx, grad_input=z)


RELU = Act("relu")


@dataclass(frozen=True)
class PoolSpec:
    """A max-pool window: kernel, stride, padding as (h, w); dilation 1, floor mode."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        return ((h + 2 * self.padding[0] - self.kernel[0]) // self.stride[0] + 1,
                (w + 2 * self.padding[1] - self.kernel[1]) // self.stride[1] + 1)

    def args(self) -> tuple[list[int], list[int], list[int]]:
        return list(self.kernel), list(self.stride), list(self.padding)

    @property
    def sentinel(self) -> int:
        """Window index stored where the activation's derivative at the pooled max is 0: no gradient flows."""
        return self.kernel[0] * self.kernel[1]


def scale_shift(channels, weight, bias, mean, invstd, device, dtype=torch.float32):
    """Per-channel (scale, shift) in ``dtype`` (fp32, or fp64 for an fp64 model) so that
    ``bn(y) = y * scale + shift``; None stats mean identity."""
    one = torch.ones(channels, device=device, dtype=dtype)
    scale = one if invstd is None else invstd.to(dtype)
    if weight is not None:
        scale = scale * weight.to(dtype)
    shift = torch.zeros_like(one) if bias is None else bias.to(dtype).clone()
    if mean is not None:
        shift = shift - mean.to(dtype) * scale
    return scale, shift


def slope_view(slope: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A PReLU weight shaped to broadcast over ``like``'s dim 1 ([C] -> (1, C, 1, ...); [1] -> (1,)), as F.prelu."""
    return slope.view((1, -1) + (1,) * (like.dim() - 2)) if slope.numel() > 1 else slope.view(1)


def slope_args(slope: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(fp32 slopes, one per channel?)`` for a Triton kernel's PReLU arguments; ``stand_in`` as the pointer (never
    read) where there is no PReLU."""
    if slope is None:
        return stand_in, 0
    return slope.detach().float().contiguous(), int(slope.numel() > 1)
