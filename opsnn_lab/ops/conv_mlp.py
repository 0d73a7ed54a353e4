"""``conv2(dropout(act(conv1(x))))`` in one autograd op: the MLP of channels-first blocks.

Blocks that keep their feature maps as (N, C, H, W) write their MLP with 1x1 convolutions (timm's ``ConvMlp`` and
``Mlp(use_conv=True)``: FocalNet, PoolFormer, EfficientFormer, RDNet), and any ``Conv2d -> act -> Conv2d`` has the
same shape. Eager saves the input, the pre-activation (for the activation's gradient) and the activation's output
(for conv2's weight gradient), the widest two when the MLP widens. This op saves the input and the pre-activation;
backward recomputes the activation and its dropout mask (counter RNG at ``(seed, offset)``, the contract of
``opsnn_lab.ops.dropout``: element ``e`` of the row-major (N, C, H, W) tensor draws counter ``offset + e``, as an
``nn.Dropout`` there does under ``ol.consistency.make_reproducible``).

Activation and mask run through ``kernels.gelu_dropout`` (its Triton kernels on a GPU, torch elsewhere), each
convolution's gradients through aten's ``convolution_backward``, the call autograd makes for an eager conv (a 1x1
conv's input gradient on CPU as one GEMM: ``ops._conv_grad``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_range, check_tensor, check_type, first_derivative_only, same_device
from opsnn_lab.kernels.gelu_dropout import act_dropout_bwd, act_dropout_fwd, act_forward
from opsnn_lab.ops import _amp
from opsnn_lab.ops._conv_bn_args import as_planes, conv_padding, keeps_forward, ntuple
from opsnn_lab.ops._conv_grad import convolution_backward
from opsnn_lab.ops._mlp_parts import ACTS, parse_act_dropout, supports_of
from opsnn_lab.ops.dropout import CounterRNG, Dropout

__all__ = ["FusedConvActDropoutConv", "ConvActDropoutConvFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class _Geometry:
    """A Conv2d's stride, padding, dilation and groups, as ``convolution_backward`` takes them."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    @classmethod
    def of(cls, conv: nn.Conv2d) -> _Geometry:
        """A Conv1d's as a 2-d conv's of height 1 (the op runs a 1-d MLP so, as aten runs a 1-d conv)."""
        n = 1 if isinstance(conv, nn.Conv1d) else 2
        return cls(as_planes(ntuple(conv.stride, n), 1), as_planes(conv_padding(conv), 0),
                   as_planes(ntuple(conv.dilation, n), 1), conv.groups)

    def conv(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def backward(self, grad, x, weight, has_bias: bool, mask):
        return convolution_backward(grad, x, weight, [weight.shape[0]] if has_bias else [0], self.stride,
                                    self.padding, self.dilation, self.groups, mask)


_CL = torch.channels_last


def _order(h: torch.Tensor, p: float) -> str:
    """How the activation kernels walk ``h``: ``"nhwc"`` (memory order, a view) for a channels-last map when no mask
    is drawn, else ``"nchw"``: the dropout's counters run over the row-major (N, C, H, W) index."""
    return "nhwc" if p == 0 and not h.is_contiguous() and h.is_contiguous(memory_format=_CL) else "nchw"


def _rows(t: torch.Tensor, order: str) -> torch.Tensor:
    """A (N, C, H, W) tensor as the 2-D rows the kernels take, in ``order`` (a view where the layout allows)."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(n * h * w, c) if order == "nhwc" else t.reshape(n * c, h * w)


def _maps(rows: torch.Tensor, order: str, shape, channels_last: bool) -> torch.Tensor:
    """Rows back as a (N, C, H, W) tensor in the layout eager's would have (channels-last where ``h`` was)."""
    n, c, h, w = shape
    if order == "nhwc":
        return rows.view(n, h, w, c).permute(0, 3, 1, 2)
    out = rows.view(n, c, h, w)
    return out.contiguous(memory_format=_CL) if channels_last else out


class ConvActDropoutConvFunction(torch.autograd.Function):
    """``apply(x, weight1, bias1, weight2, bias2, geometry1, geometry2, p, seed, offset, act)``."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight1, bias1, weight2, bias2, geo1, geo2, p, seed, offset, act):
        h = geo1.conv(x, weight1, bias1)
        order, cl = _order(h, p), not h.is_contiguous() and h.is_contiguous(memory_format=_CL)
        d, h_rows = act_dropout_fwd(_rows(h, order), p, seed, offset, act)
        ctx.cfg = (geo1, geo2, p, seed, offset, act, h.shape, order, cl, bias1 is not None, bias2 is not None)
        ctx.save_for_backward(x, weight1, weight2, h_rows)
        return geo2.conv(_maps(d, order, h.shape, cl), weight2, bias2)  # in the layout eager's output has

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("FusedConvActDropoutConv")
        x, weight1, weight2, h_rows = ctx.saved_tensors
        geo1, geo2, p, seed, offset, act, shape, order, cl, has_b1, has_b2 = ctx.cfg
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        h = _maps(h_rows, order, shape, cl)  # conv2's input as the forward gave it: its gradients' layout follows
        first = need_x or need_w1 or (need_b1 and has_b1)
        # conv2's input gradient needs only its input's shape and layout: the pre-activation stands in
        grad_d = geo2.backward(grad, h, weight2, has_b2, [True, False, False])[0] if first else None
        if first:
            grad_h, _, d = act_dropout_bwd(_rows(grad_d, order), h_rows, p, seed, offset, act, want_out=need_w2)
        elif need_w2:
            d, _ = act_dropout_fwd(h_rows.clone(), p, seed, offset, act)
        grad_w2 = grad_b2 = None
        if need_w2 or (need_b2 and has_b2):
            _, grad_w2, grad_b2 = geo2.backward(grad, _maps(d, order, shape, cl) if need_w2 else h, weight2,
                                                has_b2, [False, need_w2, need_b2 and has_b2])
        grad_x = grad_w1 = grad_b1 = None
        if first:
            grad_x, grad_w1, grad_b1 = geo1.backward(_maps(grad_h, order, shape, cl), x, weight1, has_b1,
                                                     [need_x, need_w1, need_b1 and has_b1])
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None, None


def _check_conv(name: str, conv, kind=None) -> str:
    """'' or why ``conv`` is not a Conv2d / Conv1d the op takes (``kind``: the one conv1 is, for conv2)."""
    kinds = (kind,) if kind is not None else (nn.Conv2d, nn.Conv1d)
    if not any(keeps_forward(conv, k) for k in kinds):
        want = kind.__name__ + " as conv1 is" if kind is not None else "Conv2d or Conv1d"
        return f"{name} must be {want} (or a subclass keeping its forward), got {type(conv).__name__}"
    if conv.padding_mode != "zeros":
        return f"{name}.padding_mode={conv.padding_mode!r} is not supported (only 'zeros')"
    if conv_padding(conv) is None:
        return f"{name}.padding='same' with an even dilated kernel pads asymmetrically; not supported"
    return ""


def _kind(conv) -> type:
    return nn.Conv1d if isinstance(conv, nn.Conv1d) else nn.Conv2d


def _parse(conv1, act, dropout, conv2) -> tuple[str, float]:
    """``(act_name, p)``, or TypeError / ValueError naming the argument."""
    why = _check_conv("conv1", conv1) or _check_conv("conv2", conv2, _kind(conv1))
    if why:
        raise TypeError(why)
    if conv2.in_channels != conv1.out_channels:
        raise ValueError(f"conv2 must have in_channels={conv1.out_channels} (conv1's out_channels), "
                         f"got {conv2.in_channels}")
    if conv2.weight.dtype != conv1.weight.dtype or conv2.weight.device != conv1.weight.device:
        raise TypeError("conv2 must have conv1's dtype and device, got "
                        f"{conv2.weight.dtype}/{conv2.weight.device} vs {conv1.weight.dtype}/{conv1.weight.device}")
    return parse_act_dropout(act, dropout)


class FusedConvActDropoutConv(CounterRNG, nn.Module):
    """``conv2(Dropout(act(conv1(x))))`` in one autograd op; ``act`` in gelu, gelu_tanh, quick_gelu, silu, relu.

    Contract (``supports`` says why a set of modules does not meet it; ``from_modules`` raises TypeError /
    ValueError naming the argument for the same reasons):

    * ``conv1``, ``conv2``: ``nn.Conv2d`` (or a subclass keeping its forward), zero padding, any kernel, stride,
      dilation and groups; ``conv2.in_channels == conv1.out_channels``, one dtype and device. Or two ``nn.Conv1d``
      (a speech model's convolutional feed-forward, Whisper's stem): run as 2-d ones of height 1, the same
      dropout mask (element ``e`` of the row-major (N, C, L) tensor draws counter ``offset + e``).
    * ``act``: as ``FusedLinearActDropout``'s (a module computing one of the activations, checked on a probe).
    * ``dropout``: None, ``nn.Dropout`` or ``opsnn_lab.ops.Dropout`` (element-wise; not ``Dropout2d``).
    * ``x``: (N, C, H, W) for a 2-d pair, (N, C, L) for a 1-d one; an unbatched (C, H, W) / (C, L) input, which the
      convs take, runs as a batch of one.
    * The convolutions are used by reference and their Parameters read at each call, so the module they sit in
      keeps its state_dict; ``register_modules=True`` (default) also registers them as ``conv1`` / ``conv2``.
    * Saved for backward: x and the pre-activation; never the activation's output or a mask.
    """

    def __init__(self, conv1: nn.Conv2d, act: str, conv2: nn.Conv2d, p: float = 0.0, *, seed: int | None = None,
                 register_modules: bool = True):
        super().__init__()
        why = _check_conv("conv1", conv1) or _check_conv("conv2", conv2, _kind(conv1))
        if why:
            raise TypeError(why)
        if act not in ACTS:
            raise ValueError(f"act must be one of {ACTS}, got {act!r}")
        self.act, self.p = act, float(check_range("p", p, 0.0, 1.0))
        self.geometry = (_Geometry.of(conv1), _Geometry.of(conv2))
        if check_type("register_modules", register_modules, bool):
            self.conv1, self.conv2 = conv1, conv2
        else:
            object.__setattr__(self, "_convs", (conv1, conv2))
        self._init_rng(seed)

    @classmethod
    def supports(cls, conv1, act, dropout=None, conv2=None) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(conv1, act, dropout, conv2)`` would build, else ``(False, reason)``."""
        return supports_of(_parse, conv1, act, dropout, conv2)

    @classmethod
    def from_modules(cls, conv1: nn.Module, act: nn.Module, dropout: nn.Module | None, conv2: nn.Module, *,
                     seed: int | None = None, register_modules: bool = True) -> FusedConvActDropoutConv:
        act_name, p = _parse(conv1, act, dropout, conv2)
        if seed is None and isinstance(dropout, Dropout):  # an already counter-based dropout lends its stream
            seed = dropout.rng_seed
        return cls(conv1, act_name, conv2, p, seed=seed, register_modules=register_modules).train(conv1.training)

    @property
    def convs(self) -> tuple[nn.Conv2d, nn.Conv2d]:
        return (self.conv1, self.conv2) if "conv1" in self._modules else self.__dict__["_convs"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv1, conv2 = self.convs
        one_d = isinstance(conv1, nn.Conv1d)
        if isinstance(x, torch.Tensor) and x.dim() == (2 if one_d else 3):  # unbatched, as the convs take it
            return self.forward(x.unsqueeze(0)).squeeze(0)  # a batch of one, as aten runs an unbatched conv
        with _amp.region(x) as cast:  # under autocast: the convolutions' casts, autocast off inside
            x, w1, b1, w2, b2 = cast(x, conv1.weight, conv1.bias, conv2.weight, conv2.bias)
            check_tensor("x", x, dtypes=_FLOATS, dim=3 if one_d else 4)
            if x.shape[1] != conv1.in_channels:
                raise ValueError(f"x must have {conv1.in_channels} channels (dim 1), got shape {tuple(x.shape)}")
            if x.dtype != w1.dtype:
                raise TypeError(f"x has dtype {x.dtype} but the weights are {w1.dtype}; cast one of them")
            same_device(weight=w1, x=x)
            if one_d:  # as 2-d maps of height 1; the output contiguous, as aten's 1-d conv gives it for any input
                x, w1, w2 = x.unsqueeze(2), w1.unsqueeze(2), w2.unsqueeze(2)
                return self._maps(x, w1, b1, w2, b2).squeeze(2).contiguous()
            return self._maps(x, w1, b1, w2, b2)

    def _maps(self, x, w1, b1, w2, b2):
        """The MLP on (N, C, H, W) maps and 4-d weights, autocast's casts made."""
        if not self.training and not torch.is_grad_enabled():  # nothing to save: plain ops
            return _plain(self.geometry, x, w1, b1, w2, b2, self.act)
        # eval with grad (a Dropout switched off in a training model): the fused op without a draw
        seed, offset = self.next_draw(x) if self.training else (0, 0)
        if x.numel() == 0:  # nothing to drop; the draw still counts as a step (the dropout contract)
            return _plain(self.geometry, x, w1, b1, w2, b2, self.act)
        p = self.p if self.training else 0.0
        geo1, geo2 = self.geometry
        return ConvActDropoutConvFunction.apply(x, w1, b1, w2, b2, geo1, geo2, p, seed, offset, self.act)

    def extra_repr(self) -> str:
        conv1, conv2 = self.convs
        return (f"{conv1.in_channels} -> {conv1.out_channels} -> {conv2.out_channels}, act={self.act!r}, "
                f"p={self.p}")


def _plain(geometry, x, w1, b1, w2, b2, act):
    geo1, geo2 = geometry
    return geo2.conv(act_forward(geo1.conv(x, w1, b1), act), w2, b2)
