"""Conv2d (grouped, depthwise) -> BatchNorm2d -> activation (-> MaxPool2d) as one autograd Function that saves
only the conv input, the conv output and per-channel statistics (with a pool: uint8 within-window indices
instead of int64). A stride-1 depthwise conv's output is recomputed in backward instead of saved: it costs
one pass over the input, and the bytes fall from 2/3 to 1/3 of eager's. At stride 2 the output is a quarter
of the input, and recomputing it (a pass over 4x its size) would save 1/6 of the chain's bytes for ~20% of its
time: it is saved unless ``recompute=True``. Activations: ReLU, ReLU6, LeakyReLU, SiLU, Hardswish, GELU (erf
and tanh), Mish, ELU (alpha 1), and PReLU without a pool (its weight trained by the op; under autocast it runs in
autocast's dtype, as eager's ``prelu``). The same chain of 1-d modules (a temporal or speech convolution block, with
MaxPool1d) and of 3-d ones (video and volume models, no pool) is taken too: ``_conv_bn_args.py``.

Activation bytes on the ResNet stem (8x3x224x224, 3->64 k7 s2, BN, ReLU, MaxPool 3/2/1): eager saves x, the
conv output, the ReLU output and int64 pool indices (69.0 MB); this op saves x, the conv output and one
byte per pooled element (32.1 MB, 0.465x). BN + activation are recomputed in backward from the conv output
and the statistics; for a monotone activation act-then-pool becomes pool-then-act (equal). On CPU with a
pool the op runs channels-last inside (aten's max-pool is far faster there) and hands the output back in
the layout eager would give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from opsnn_lab._checks import check_tensor, check_type, first_derivative_only
from opsnn_lab.kernels.bn_act import RELU, Act, PoolSpec, acc_dtype, bn_act_backward, bn_act_forward
from opsnn_lab.ops import _amp
from opsnn_lab.ops._activations import is_prelu, prelu_weight
from opsnn_lab.ops._conv_bn_args import (
    act_spec,
    as_planes,
    conv_dim,
    conv_padding,
    ntuple,
    pool_spec,
    same_pads,
    why_not,
    wrong_type,
)
from opsnn_lab.ops._conv_grad import convolution_backward

__all__ = ["FusedConvBNAct", "FusedConvBNReLU", "ConvBNActFunction", "ConvBNReLUFunction"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Config:  # 2-d settings for a 1-d or 2-d conv (a 1-d one runs as a 2-d one of height 1), 3-d ones for a 3-d
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    eps: float
    training: bool
    momentum: float  # effective factor of this step (F.batch_norm's ``momentum`` argument)
    pool: PoolSpec | None
    act: Act = RELU
    # training: recompute the conv output in backward instead of saving it (by default a stride-1 depthwise
    # conv: k*k multiply-adds per output, one pass over its input, which backward keeps anyway)
    recompute: bool = False
    # CPU with a pool: run channels-last inside (see _internal); off under deterministic algorithms (strict()),
    # where aten's channels-last batch-norm and conv weight-gradient reductions split rows over threads
    channels_last: bool = False
    one_d: bool = False  # a 1-d chain run as a 2-d one: its output contiguous, as aten's 1-d conv gives for any input

    def conv_args(self):
        return list(self.stride), list(self.padding), list(self.dilation)


def _internal(t: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """With a pool, CPU tensors run channels-last inside the op: aten's CPU max-pool is ~50x faster there
    (3/2 pool on the stem's 8x64x112x112: 3 ms vs 180 ms) and batch-norm forward ~3x, which pays for the
    layout copies. Without a pool the copies of a full-size output and gradient would cost more than the
    batch-norm gains, so the input's own layout is kept."""
    if not cfg.channels_last or t.device.type != "cpu":
        return t
    return t.contiguous(memory_format=torch.channels_last)


def _like_input(out: torch.Tensor, x: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """The output in the layout eager gives for ``x``: channels-last only for a channels-last input."""
    if out.device.type != "cpu":
        return out
    if cfg.one_d:
        return out.contiguous()
    last = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    cl = x.is_contiguous(memory_format=last) and not x.is_contiguous()
    return out.contiguous(memory_format=last if cl else torch.contiguous_format)


def _conv(x, weight, bias, cfg: _Config) -> torch.Tensor:
    return (F.conv3d if x.dim() == 5 else F.conv2d)(_internal(x, cfg), weight, bias, *cfg.conv_args(), cfg.groups)


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [C] tensor shaped to scale ``like``'s output channels (a conv weight: [C, 1, 1, 1] or [C, 1, 1, 1, 1])."""
    return t.view(-1, *[1] * (like.dim() - 1))


def _planes(t: torch.Tensor) -> torch.Tensor:
    """A 3-d conv's maps as (N, C, D, H * W) for the statistics pass (a view for the layouts a conv gives)."""
    return t.flatten(3) if t is not None and t.dim() == 5 else t


def _unplanes(t: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``_planes`` undone, to ``like``'s shape (None: a 1-d or 2-d one, as it is)."""
    return t.unflatten(3, like.shape[3:]) if like is not None and like.dim() == 5 else t


def _zeros_like_or_none(t, needed):
    return torch.zeros_like(t) if needed and t is not None else None


class ConvBNActFunction(torch.autograd.Function):
    """Training: batch statistics + running-stat update; eval: BatchNorm folded into the conv.

    Saved for backward: training -> x, conv output y (recomputed from x instead for a depthwise conv),
    mean, invstd [C] (+ uint8 pool index);
    eval -> x, the folded conv output (none with a pool and ReLU/ReLU6: the uint8 index's sentinel holds
    the derivative), the folding factors [C] (+ uint8 pool index). Never a second full-size tensor.
    """

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight, bias, bn_weight, bn_bias, running_mean, running_var, cfg: _Config, slope=None):
        ctx.cfg, ctx.has_bias = cfg, bias is not None  # every branch saves ``slope`` (a PReLU's weight) last
        if cfg.training:
            y = _conv(x, weight, bias, cfg)
            ctx.empty = y.numel() == 0
            if ctx.empty:  # as nn.BatchNorm2d: empty output, running statistics untouched
                ctx.save_for_backward(x, weight, slope)
                return _empty_output(y, cfg.pool, slope.dtype if slope is not None else None)
            out, mean, invstd, idx = bn_act_forward(_planes(y), bn_weight, bn_bias, running_mean, running_var,
                                                    training=True, momentum=cfg.momentum, eps=cfg.eps,
                                                    act=cfg.act, pool=cfg.pool, slope=slope)
            # recompute: backward runs the same conv on the same input (the same bits), so y is not kept
            ctx.save_for_backward(x, weight, bias if cfg.recompute else None, bn_weight, bn_bias,
                                  None if cfg.recompute else y, mean, invstd, idx, slope)
            return _like_input(_unplanes(out, y), x, cfg)
        # folded in fp32 for fp32/bf16/fp16 inputs, in fp64 for fp64 ones (fp32 would cost fp64 ~1e-8 relative)
        acc = acc_dtype(x.dtype)
        mean = running_mean.detach().clone()
        invstd = torch.rsqrt(running_var.to(acc) + cfg.eps)
        fold = bn_weight.to(acc) * invstd
        w_f = (weight.to(acc) * _per_channel(fold, weight)).to(weight.dtype)
        b0 = mean.to(acc).neg() if bias is None else bias.to(acc) - mean.to(acc)
        a = _conv(x, w_f, (b0 * fold + bn_bias.to(acc)).to(x.dtype), cfg)
        ctx.empty = a.numel() == 0
        if ctx.empty:
            ctx.save_for_backward(x, weight, slope)
            return _empty_output(a, cfg.pool, slope.dtype if slope is not None else None)
        out, _, _, idx = bn_act_forward(_planes(a), None, None, None, None, training=False, momentum=0.0,
                                        eps=cfg.eps, act=cfg.act, pool=cfg.pool, slope=slope)
        ctx.in_shape = tuple(_planes(a).shape)
        keep_a = cfg.pool is None or not cfg.act.has_dead_zone
        ctx.save_for_backward(x, weight, bn_weight, a if keep_a else None, b0, invstd, idx, slope)
        return _like_input(_unplanes(out, a), x, cfg)

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad_out):
        first_derivative_only("FusedConvBNAct")
        if ctx.empty:
            return _empty_grads(ctx, *ctx.saved_tensors)
        # With a pool, the sentinel-masking pass also moves the gradient to the index's layout.
        if ctx.cfg.training:
            return _backward_train(ctx, grad_out)
        return _backward_eval(ctx, grad_out)


def _empty_output(y: torch.Tensor, pool: PoolSpec | None, dtype=None) -> torch.Tensor:
    if pool is None:
        return y.new_empty(y.shape, dtype=dtype or y.dtype)
    return y.new_empty(*y.shape[:2], *pool.out_size(*y.shape[-2:]))


def _empty_grads(ctx, x, weight, slope):
    """Gradients of an empty batch: zeros for every parameter, as eager autograd gives."""
    need = ctx.needs_input_grad
    c = weight.shape[0]
    zeros = lambda ok: weight.new_zeros(c) if ok else None
    return (_zeros_like_or_none(x, need[0]), _zeros_like_or_none(weight, need[1]),
            zeros(need[2] and ctx.has_bias), zeros(need[3]), zeros(need[4]), None, None, None,
            *_slope_grad(ctx, [_zeros_like_or_none(slope, slope is not None)]))


def _conv_backward(ctx, grad_y, x, weight, need_w):
    cfg, need = ctx.cfg, ctx.needs_input_grad
    # [0] without a bias: the same call autograd makes for the eager conv, so ATen picks the same kernels
    bias_sizes = [weight.shape[0]] if ctx.has_bias else [0]
    return convolution_backward(grad_y, x, weight, bias_sizes, *cfg.conv_args(), cfg.groups,
                                [need[0], need_w, need[2] and ctx.has_bias])


def _backward_train(ctx, grad_out):
    x, weight, bias, bn_weight, bn_bias, y, mean, invstd, idx, slope = ctx.saved_tensors
    cfg, need = ctx.cfg, ctx.needs_input_grad
    if y is None:
        y = _conv(x, weight, bias, cfg)
    grad_y, grad_gamma, grad_beta, *gs = bn_act_backward(
        _planes(grad_out), _planes(y), bn_weight, bn_bias, mean, invstd, idx, training=True, eps=cfg.eps, act=cfg.act,
        pool=cfg.pool, output_mask=(True, need[3], need[4]), slope=slope)
    dx, dw, db = _conv_backward(ctx, _unplanes(grad_y, y), _internal(x, ctx.cfg), weight, need[1])
    return dx, dw, db, grad_gamma, grad_beta, None, None, None, *_slope_grad(ctx, gs)


def _backward_eval(ctx, grad_out):
    """Gradients through the folded conv: w_f = w * s, b_f = (b - mean) * s + beta, s = gamma * invstd."""
    x, weight, bn_weight, a, b0, invstd, idx, slope = ctx.saved_tensors
    cfg, need = ctx.cfg, ctx.needs_input_grad
    acc = invstd.dtype  # the forward's acc_dtype(x.dtype)
    fold = bn_weight.to(acc) * invstd
    w_f = (weight.to(acc) * _per_channel(fold, weight)).to(weight.dtype)
    grad_a, _, _, *gs = bn_act_backward(_planes(grad_out), _planes(a), None, None, None, None, idx, training=False,
                                        eps=cfg.eps, act=cfg.act, pool=cfg.pool, in_shape=ctx.in_shape,
                                        output_mask=(True, False, False), slope=slope)
    need_wf = need[1] or need[3]
    bias_sizes = [weight.shape[0]]
    dx, dw_f, db_f = convolution_backward(_unplanes(grad_a, a), _internal(x, cfg), w_f, bias_sizes, *cfg.conv_args(),
                                          cfg.groups, [need[0], need_wf, True])
    db_f = db_f.to(acc)
    dw = (dw_f.to(acc) * _per_channel(fold, weight)).to(weight.dtype) if need[1] else None
    db = (db_f * fold).to(weight.dtype) if need[2] and ctx.has_bias else None
    dgamma = None
    if need[3]:
        dfold = (dw_f.to(acc) * weight.to(acc)).sum(tuple(range(1, weight.dim()))) + db_f * b0
        dgamma = (dfold * invstd).to(bn_weight.dtype)
    dbeta = db_f.to(bn_weight.dtype) if need[4] else None
    return dx, dw, db, dgamma, dbeta, None, None, None, *_slope_grad(ctx, gs)


def _slope_grad(ctx, gs: list) -> tuple:
    """The slope's gradient where the Function was given a ninth input (``gs``: bn_act_backward's fourth value,
    empty without a PReLU), else nothing."""
    need = ctx.needs_input_grad
    return (gs[0] if gs and need[8] else None,) if len(need) > 8 else ()


ConvBNReLUFunction = ConvBNActFunction  # the name the ReLU-only op had; same Function


class FusedConvBNAct(nn.Module):
    """Drop-in for ``nn.Sequential(conv, bn, act[, maxpool])`` that keeps a fraction of the activations.

    The contract a graph rewrite uses (``conv_bn_<act>[_maxpool]`` patterns):

    * ``supports(conv, bn, act, maxpool=None) -> (ok, reason)`` never raises; ``reason`` names the first
      unsupported argument or attribute (``conv``, ``bn``, ``act``, ``maxpool``, e.g. ``"conv.padding_mode=
      'reflect' is not supported"``). ``from_modules`` with the same arguments raises TypeError for a module
      of the wrong kind and ValueError for a supported kind with unsupported settings, with that reason.
    * ``conv``: ``nn.Conv2d``, ``nn.Conv1d`` or ``nn.Conv3d`` (or a subclass keeping its forward), any ``groups``
      (grouped, depthwise), stride, dilation, numeric or ``'valid'``/``'same'`` padding (``'same'`` only where it
      is symmetric), ``padding_mode='zeros'``. A 1-d chain runs as a 2-d one of height 1; a 3-d chain runs its own
      convolution (``_conv_bn_args.py``).
    * ``bn``: the BatchNorm of the conv's dimension (``nn.BatchNorm2d`` after a Conv2d, ``BatchNorm1d`` after a
      Conv1d, ``BatchNorm3d`` after a Conv3d) with ``affine`` and ``track_running_stats``, ``num_features ==
      conv.out_channels``; any ``momentum`` (None: cumulative average), any ``eps``. A subclass with its own
      forward is taken when that forward computes ``act(BatchNorm2d(x))`` with ``act`` its child (timm's
      ``BatchNormAct2d``; the fused op then replaces the BatchNorm and its activation), or BatchNorm2d alone
      when it has no child besides ``nn.Identity`` ones: checked on a probe (``ops/_bn_act.py``).
    * ``act``: ``nn.ReLU``, ``nn.ReLU6``, ``nn.LeakyReLU`` (any ``negative_slope``), ``nn.SiLU``,
      ``nn.Hardswish``, ``nn.GELU`` (``approximate`` ``'none'`` or ``'tanh'``), ``nn.Mish``, ``nn.ELU``
      (``alpha=1``), or the Hugging Face
      ``ACT2FN`` modules ``GELUActivation``, ``NewGELUActivation``, ``FastGELUActivation``, ``GELUTanh``,
      ``PytorchGELUTanh``, ``AccurateGELUActivation``, ``SiLUActivation`` (matched by class name and
      checked on a probe tensor; transformers is not imported). ``self.act_spec`` is the resolved
      :class:`~opsnn_lab.kernels.bn_act.Act` (its ``name`` is the pattern's ``<act>``). ``inplace`` is
      irrelevant: the activation's input is never exposed.
    * ``maxpool``: None or exactly the max-pool of the conv's dimension (``nn.MaxPool2d``, ``nn.MaxPool1d``; none
      after a Conv3d) with dilation 1, ``ceil_mode=False``,
      ``return_indices=False``, at most 255 window cells, padding at most half the kernel.

    Parameter/buffer contract:

    * The module reads every tensor from the ORIGINAL modules at call time: ``conv.weight``,
      ``conv.bias`` (or None), ``bn.weight``, ``bn.bias``, ``bn.running_mean``, ``bn.running_var``,
      ``bn.num_batches_tracked``. Nothing is copied, so ``.to()``, optimizers and ``load_state_dict`` on
      the originals act on the fused module too, and training updates the originals' running stats.
    * ``register_modules=True`` (default): the originals are submodules ``conv``, ``bn``, ``act`` (``relu``
      for :class:`FusedConvBNReLU`) and ``maxpool`` (absent when None), so this module's own
      ``state_dict`` keys are ``conv.weight``, ``conv.bias``, ``bn.weight``, ``bn.bias``,
      ``bn.running_mean``, ``bn.running_var``, ``bn.num_batches_tracked``: placing it where ``conv``/``bn``
      were inside a ``Sequential`` named ``conv``/``bn`` keeps keys identical.
    * ``register_modules=False``: the originals are held outside the module tree (``self.conv`` etc. are
      plain attributes) and this module has NO parameters, buffers or state_dict keys. Use it when the
      originals stay at their own paths in the model (unused by the rewritten graph): the model's
      ``state_dict`` keys and values are then exactly the unfused model's.
    * ``self.training`` (this module's flag) selects batch statistics (train) or the folded BN (eval).
      In train mode ``bn.num_batches_tracked`` is incremented and the running stats are updated exactly
      as ``nn.BatchNorm2d`` does (``momentum=None``: cumulative average).

    ``pad_same``: the conv is a Conv2d subclass whose own forward pads its input TensorFlow's 'same' way for each
    call and then convolves with no padding (timm's ``Conv2dSame``, EfficientNet-PyTorch's dynamic one: the fusion
    analysis checks that on a probe); the op pads the input so (``_conv_bn_args.same_pads``) and keeps the padded
    input for backward, as eager's conv does.

    ``recompute``: None (default) recomputes the conv output in backward, in training, for a stride-1 2-d or 3-d
    depthwise conv and saves it otherwise; True / False always recompute / save it (the same bits either way). A
    1-d depthwise conv saves it by default: recomputing cost 7-27% of the chain's step (kernels 5 to 31, 256
    channels, 896 frames, Xeon, 2 threads), against 1-3% for a 3x3x3 one.

    Saved for backward: the conv input, the conv output (unless recomputed from the input), two fp32 values
    per channel, and with a pool one uint8 per pooled element; the BN
    output and the activation's output are recomputed. Empty batch:
    behaves as eager (empty output, running stats unchanged, ``num_batches_tracked`` + 1, zero parameter
    gradients). One value per channel in training raises ValueError, as eager does.
    """

    _act_attr = "act"  # the submodule name of the activation
    _relu_only = False
    prelu = False  # the activation is a PReLU, its weight passed to the Function at each call
    dim = 2  # the convolution's (set per instance; the class values read a module pickled before these options)
    pad_same = False

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: nn.Module, maxpool: nn.MaxPool2d | None = None,
                 *, register_modules: bool = True, recompute: bool | None = None, pad_same: bool = False):
        super().__init__()
        check_type("register_modules", register_modules, bool)
        self.recompute = check_type("recompute", recompute, bool, allow_none=True)
        self.pad_same = check_type("pad_same", pad_same, bool)
        wrong = wrong_type(conv, bn, act, maxpool, self._act_attr, self._relu_only, pad_same)
        if wrong:
            raise TypeError(wrong)
        reason = why_not(conv, bn, act, maxpool, self._act_attr, self._relu_only, pad_same)
        if reason:
            raise ValueError(reason)
        self.register_modules = register_modules
        self.act_spec = act_spec(act)
        self.prelu = is_prelu(act)
        setter = nn.Module.__setattr__ if register_modules else object.__setattr__
        for name, mod in (("conv", conv), ("bn", bn), (self._act_attr, act), ("maxpool", maxpool)):
            setter(self, name, mod)
        self.dim = conv_dim(conv, pad_same)  # 1, 2 or 3
        self.pool = pool_spec(maxpool, self.dim)
        self.train(conv.training)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: nn.Module, maxpool: nn.MaxPool2d | None = None,
                     *, register_modules: bool = True, recompute: bool | None = None, pad_same: bool = False):
        """Fuse existing modules, sharing their Parameter and buffer objects (see the class docstring)."""
        return cls(conv, bn, act, maxpool, register_modules=register_modules, recompute=recompute, pad_same=pad_same)

    @classmethod
    def supports(cls, conv, bn, act, maxpool=None, *, pad_same: bool = False) -> tuple[bool, str]:
        """``(True, '')`` when the chain can be fused, else ``(False, reason)`` naming the argument."""
        reason = why_not(conv, bn, act, maxpool, cls._act_attr, cls._relu_only, pad_same)
        return (not reason, reason)

    def live_settings(self) -> tuple:
        """``(module, attribute)``: the BatchNorm's ``momentum`` and ``eps``, read at every call (a momentum
        schedule reaches the fused op; a rewrite need not run the chain unfused when they change)."""
        return (self.bn, "momentum"), (self.bn, "eps")

    def _config(self) -> _Config:
        conv, bn = self.conv, self.bn
        factor = 0.0
        if self.training:
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
        n = self.dim
        stride = ntuple(conv.stride, n)
        recompute = self.recompute
        if recompute is None:
            recompute = conv.groups > 1 and conv.groups == conv.in_channels and set(stride) == {1} and n > 1
        channels_last = self.pool is not None and not torch.are_deterministic_algorithms_enabled()
        return _Config(as_planes(stride, 1), as_planes(conv_padding(conv), 0), as_planes(ntuple(conv.dilation, n), 1),
                       conv.groups, bn.eps, self.training, factor, self.pool, self.act_spec,
                       recompute=self.training and recompute, channels_last=channels_last, one_d=n == 1)

    def _check_input(self, x, w) -> None:
        check_tensor("input", x, dtypes=_FLOATS, dim=self.dim + 2)
        if x.shape[1] != self.conv.in_channels:
            raise ValueError(f"input must have {self.conv.in_channels} channels (dim 1), got shape {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match conv.weight dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"input is on {x.device} but conv.weight is on {w.device}")
        if self.training and x.shape[0] == 1 and x.numel() and self._conv_map(x) == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input of shape "
                             f"{tuple(x.shape)} (one conv output value per channel)")

    def _conv_map(self, x) -> int:
        """The number of conv output values per channel and sample."""
        conv, n = self.conv, self.dim
        if self.pad_same:  # 'same': ceil(size / stride) values along each side
            return math.prod(-(-size // s) for size, s in zip(x.shape[2:], ntuple(conv.stride, n)))
        return math.prod((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in zip(
            x.shape[2:], conv_padding(conv), ntuple(conv.dilation, n), conv.kernel_size, ntuple(conv.stride, n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, bn = self.conv, self.bn
        autocast = _amp.autocast_dtype(x)  # before the region, which turns autocast off
        with _amp.region(x) as cast:  # under autocast: the conv's operands cast, BN's parameters and statistics not
            x, weight, bias = cast(x, conv.weight, conv.bias)
            self._check_input(x, weight)
            slope = prelu_weight(getattr(self, self._act_attr).weight, x, autocast, self._act_attr) \
                if self.prelu else None
            if self.pad_same:  # as the conv's own forward does: what its backward keeps is the padded input
                x = F.pad(x, same_pads(x.shape[2:], conv.kernel_size, conv.stride, conv.dilation))
            if self.dim == 1:  # as a 2-d chain of height 1; autograd takes the gradients back through the views
                x, weight = x.unsqueeze(2), weight.unsqueeze(2)
            args = (x, weight, bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, self._config())
            out = ConvBNActFunction.apply(*args, *([slope] if slope is not None else []))
            return out.squeeze(2) if self.dim == 1 else out

    def extra_repr(self) -> str:
        pool = "" if self.pool is None else f", pool={self.pool}"
        recompute = "" if self.recompute is None else f", recompute={self.recompute}"
        same = ", pad_same=True" if self.pad_same else ""
        act = "prelu" if self.prelu else self.act_spec
        return f"act={act}, register_modules={self.register_modules}{pool}{recompute}{same}"


class FusedConvBNReLU(FusedConvBNAct):
    """:class:`FusedConvBNAct` restricted to ``nn.ReLU`` (submodule ``relu``): ``from_modules(conv, bn, relu,
    maxpool=None, register_modules=True)``; any other activation is a TypeError naming ``relu``."""

    _act_attr = "relu"
    _relu_only = True

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.Module, maxpool: nn.MaxPool2d | None = None,
                 *, register_modules: bool = True, recompute: bool | None = None, pad_same: bool = False):
        super().__init__(conv, bn, relu, maxpool, register_modules=register_modules, recompute=recompute,
                         pad_same=pad_same)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.Module, maxpool: nn.MaxPool2d | None = None,
                     *, register_modules: bool = True, recompute: bool | None = None,
                     pad_same: bool = False) -> FusedConvBNReLU:
        """Fuse existing modules, sharing their Parameter and buffer objects (see :class:`FusedConvBNAct`)."""
        return cls(conv, bn, relu, maxpool, register_modules=register_modules, recompute=recompute, pad_same=pad_same)

    @classmethod
    def supports(cls, conv, bn, relu, maxpool=None, *, pad_same: bool = False) -> tuple[bool, str]:
        """``(True, '')`` when the chain can be fused, else ``(False, reason)`` naming the argument."""
        return super().supports(conv, bn, relu, maxpool, pad_same=pad_same)
