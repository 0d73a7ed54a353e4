"""What :class:`~opsnn_lab.ops.conv_bn_relu.FusedConvBNAct` takes, and its modules' settings in the op's terms.

A chain is a ``Conv{1,2,3}d`` followed by the ``BatchNorm{1,2,3}d`` of the same dimension (a temporal
convolution block, an image one, a video or volume one), an activation, and for 1-d and 2-d a max-pool of that
dimension. The op runs a 1-d chain as a 2-d one of height 1 (aten does the same with a 1-d convolution), so its
settings come back here as 2-d ones; a 3-d chain runs its own convolution and the 2-d statistics pass over its
maps flattened to (depth, height * width). Every reason names the argument it is about.
"""

from __future__ import annotations

import math

from torch import nn

from opsnn_lab.kernels.bn_act import Act, PoolSpec
from opsnn_lab.ops._activations import activation_of, is_prelu
from opsnn_lab.ops._bn_act import computes_batch_norm

__all__ = ["conv_dim", "keeps_forward", "ntuple", "conv_padding", "wrong_type", "why_not", "pool_spec", "as_planes",
           "same_pads"]

# dimension -> (convolution, its batch norm, its max-pool or None)
KINDS = {1: (nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d), 2: (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d),
         3: (nn.Conv3d, nn.BatchNorm3d, None)}


def ntuple(v, n: int) -> tuple[int, ...]:
    return (int(v),) * n if isinstance(v, int) else tuple(int(a) for a in v)


def keeps_forward(value, kind) -> bool:
    """A subclass that only renames (EfficientNet's depthwise Conv2d) computes what its base computes."""
    return isinstance(value, kind) and all(getattr(type(value), f, None) is getattr(kind, f, None)
                                           for f in ("forward", "_conv_forward"))


def conv_dim(conv, pad_same: bool = False) -> int | None:
    """1, 2 or 3 for a ``Conv1d`` / ``Conv2d`` / ``Conv3d`` (or a subclass keeping its forward), else None.
    ``pad_same``: any ``Conv2d`` subclass (its own forward pads 'same' first: the caller checked that)."""
    if pad_same:
        return 2 if isinstance(conv, nn.Conv2d) else None
    return next((d for d, (kind, _, _) in KINDS.items() if keeps_forward(conv, kind)), None)


def same_pads(size, kernel, stride, dilation) -> list[int]:
    """``F.pad``'s (left, right, top, bottom) for TensorFlow's 'same' padding of a 2-d map of ``size`` (h, w): the
    output ``ceil(size / stride)``, the odd cell after (timm's ``Conv2dSame``, EfficientNet-PyTorch's dynamic one)."""
    pads = []
    for n, k, s, d in zip(size, kernel, stride, dilation):
        total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
        pads.append((total // 2, total - total // 2))
    (top, bottom), (left, right) = pads
    return [left, right, top, bottom]


def conv_padding(conv) -> tuple[int, ...] | None:
    """Numeric symmetric padding of ``conv`` (``'valid'``/odd-kernel ``'same'`` converted), None if asymmetric."""
    n = len(conv.kernel_size)
    if conv.padding == "valid":
        return (0,) * n
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)
    return ntuple(conv.padding, n)


def wrong_type(conv, bn, act, maxpool, act_name="act", relu_only=False, pad_same=False) -> str:
    """'' when every argument is a module of a supported kind, else the reason, naming the argument."""
    dim = conv_dim(conv, pad_same)
    if dim is None:
        kinds = "Conv2d (pad_same=True)" if pad_same else "Conv1d, Conv2d or Conv3d (or a subclass keeping its forward)"
        return f"conv must be {kinds}, got {type(conv).__name__}"
    conv_kind, bn_kind, pool_kind = KINDS[dim]
    if not keeps_forward(bn, bn_kind):
        inner = act if any(c is act for c in getattr(bn, "children", tuple)()) else None
        if dim != 2:
            return f"bn must be {bn_kind.__name__} after a {conv_kind.__name__}, got {type(bn).__name__}"
        if not (isinstance(bn, nn.BatchNorm2d) and computes_batch_norm(bn, inner)):
            return (f"bn must be BatchNorm2d (a subclass keeping its forward, or one whose forward is "
                    f"{act_name}(batch_norm(x)) with {act_name} its child, checked on a probe), "
                    f"got {type(bn).__name__}")
    if relu_only and type(act) is not nn.ReLU:
        return f"{act_name} must be ReLU, got {type(act).__name__} (FusedConvBNAct takes other activations)"
    if maxpool is not None and pool_kind is None:
        return f"maxpool must be None after a {conv_kind.__name__} (no pooled 3-d chain), got {type(maxpool).__name__}"
    if maxpool is not None and type(maxpool) is not pool_kind:
        return f"maxpool must be {pool_kind.__name__} or None, got {type(maxpool).__name__}"
    return "" if is_prelu(act) else activation_of(act, act_name, also=("PReLU",))[1]


def act_spec(act) -> Act:
    """The op's :class:`Act` for a supported activation module (a PReLU's: leaky_relu, the slope read per call)."""
    return Act("leaky_relu") if is_prelu(act) else activation_of(act)[0]


def why_not(conv, bn, act, maxpool, act_name="act", relu_only=False, pad_same=False) -> str:
    """'' when the chain is supported, else the reason, naming the argument."""
    wrong = wrong_type(conv, bn, act, maxpool, act_name, relu_only, pad_same)
    if wrong:
        return wrong
    if pad_same and ntuple(conv.padding, 2) != (0, 0):
        return f"conv.padding={conv.padding} with pad_same=True: the op pads 'same' itself, the conv must add none"
    kind = type(bn).__name__ if conv_dim(conv, pad_same) != 2 else "BatchNorm2d"
    if conv.padding_mode != "zeros":
        return f"conv.padding_mode={conv.padding_mode!r} is not supported (only 'zeros')"
    if conv_padding(conv) is None:
        return "conv.padding='same' with an even dilated kernel pads asymmetrically; not supported"
    if not bn.affine:
        return f"bn.affine=False is not supported ({kind} without weight and bias)"
    if not bn.track_running_stats:
        return f"bn.track_running_stats=False is not supported ({kind} without running statistics)"
    if bn.num_features != conv.out_channels:
        return f"bn.num_features={bn.num_features} does not match conv.out_channels={conv.out_channels}"
    if is_prelu(act) and act.num_parameters not in (1, conv.out_channels):
        return f"{act_name} (PReLU) has {act.num_parameters} parameters for conv.out_channels={conv.out_channels}"
    if is_prelu(act) and maxpool is not None:
        return f"maxpool after a PReLU is not supported (only the unpooled kernels read {act_name}'s learned slope)"
    return _pool_why_not(maxpool, conv_dim(conv, pad_same)) if maxpool is not None else ""


def _pool_why_not(maxpool, dim: int) -> str:
    if any(d != 1 for d in ntuple(maxpool.dilation, dim)):
        return f"maxpool.dilation={maxpool.dilation} is not supported (only 1)"
    if maxpool.ceil_mode:
        return "maxpool.ceil_mode=True is not supported"
    if maxpool.return_indices:
        return "maxpool.return_indices=True is not supported"
    kernel = ntuple(maxpool.kernel_size, dim)
    if math.prod(kernel) > 255:  # cells 0..k-1 plus the sentinel k must fit a uint8
        return f"maxpool.kernel_size={maxpool.kernel_size} has more than 255 cells (uint8 window index)"
    if any(2 * p > k for p, k in zip(ntuple(maxpool.padding, dim), kernel)):
        return f"maxpool.padding={maxpool.padding} must be at most half of kernel_size={maxpool.kernel_size}"
    return ""


def as_planes(values: tuple[int, ...], fill: int) -> tuple[int, ...]:
    """A 1-d setting as the op's 2-d one of height 1 (``fill`` for the height: 1 for strides, 0 for paddings);
    2-d and 3-d ones as they are."""
    return (fill, *values) if len(values) == 1 else values


def pool_spec(maxpool, dim: int) -> PoolSpec | None:
    """The op's 2-d window for a ``MaxPool1d`` / ``MaxPool2d``."""
    if maxpool is None:
        return None
    stride = maxpool.stride if maxpool.stride not in (None, ()) else maxpool.kernel_size
    return PoolSpec(as_planes(ntuple(maxpool.kernel_size, dim), 1), as_planes(ntuple(stride, dim), 1),
                    as_planes(ntuple(maxpool.padding, dim), 0))
