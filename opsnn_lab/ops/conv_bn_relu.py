"""Conv2d (grouped, depthwise) -> BatchNorm2d -> activation (-> MaxPool2d) as one autograd Function that saves
only the conv input, the conv output and per-channel statistics (with a pool: uint8 within-window indices
instead of int64). A stride-1 depthwise conv's output is recomputed in backward instead of saved: it costs
one pass over the input, and the bytes fall from 2/3 to 1/3 of eager's. At stride 2 the output is a quarter
of the input, and recomputing it (a pass over 4x its size) would save 1/6 of the chain's bytes for ~20% of its
time: it is saved unless ``recompute=True``. Activations: ReLU, ReLU6, LeakyReLU, SiLU, Hardswish, GELU (erf
and tanh).

Activation bytes on the ResNet stem (8x3x224x224, 3->64 k7 s2, BN, ReLU, MaxPool 3/2/1): eager saves x, the
conv output, the ReLU output and int64 pool indices (69.0 MB); this op saves x, the conv output and one
byte per pooled element (32.1 MB, 0.465x). BN + activation are recomputed in backward from the conv output
and the statistics; for a monotone activation act-then-pool becomes pool-then-act (equal). On CPU with a
pool the op runs channels-last inside (aten's max-pool is far faster there) and hands the output back in
the layout eager would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from opsnn_lab._checks import check_tensor, check_type, first_derivative_only
from opsnn_lab.kernels.bn_act import RELU, Act, PoolSpec, acc_dtype, bn_act_backward, bn_act_forward
from opsnn_lab.ops import _amp
from opsnn_lab.ops._activations import activation_of
from opsnn_lab.ops._bn_act import computes_batch_norm
from opsnn_lab.ops._conv_grad import convolution_backward

__all__ = ["FusedConvBNAct", "FusedConvBNReLU", "ConvBNActFunction", "ConvBNReLUFunction"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Config:
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
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

    def conv_args(self):
        return list(self.stride), list(self.padding), list(self.dilation)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    """Numeric symmetric padding of ``conv`` (``'valid'``/odd-kernel ``'same'`` converted), None if asymmetric."""
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return None if any(t % 2 for t in total) else (total[0] // 2, total[1] // 2)
    return _pair(conv.padding)


def _keeps_forward(value, kind) -> bool:
    """A subclass that only renames (EfficientNet's depthwise Conv2d) computes what its base computes."""
    return isinstance(value, kind) and all(getattr(type(value), f, None) is getattr(kind, f, None)
                                           for f in ("forward", "_conv_forward"))


def _wrong_type(conv, bn, act, maxpool, act_name="act", relu_only=False) -> str:
    """'' when every argument is a module of a supported kind, else the reason, naming the argument."""
    if not _keeps_forward(conv, nn.Conv2d):
        return f"conv must be Conv2d (or a subclass keeping its forward), got {type(conv).__name__}"
    if not _keeps_forward(bn, nn.BatchNorm2d):
        inner = act if any(c is act for c in getattr(bn, "children", tuple)()) else None
        if not (isinstance(bn, nn.BatchNorm2d) and computes_batch_norm(bn, inner)):
            return (f"bn must be BatchNorm2d (a subclass keeping its forward, or one whose forward is "
                    f"{act_name}(batch_norm(x)) with {act_name} its child, checked on a probe), "
                    f"got {type(bn).__name__}")
    if relu_only and type(act) is not nn.ReLU:
        return f"{act_name} must be ReLU, got {type(act).__name__} (FusedConvBNAct takes other activations)"
    if maxpool is not None and type(maxpool) is not nn.MaxPool2d:
        return f"maxpool must be MaxPool2d or None, got {type(maxpool).__name__}"
    return activation_of(act, act_name)[1]


def _why_not(conv, bn, act, maxpool, act_name="act", relu_only=False) -> str:
    """'' when the chain is supported, else the reason, naming the argument."""
    wrong = _wrong_type(conv, bn, act, maxpool, act_name, relu_only)
    if wrong:
        return wrong
    if conv.padding_mode != "zeros":
        return f"conv.padding_mode={conv.padding_mode!r} is not supported (only 'zeros')"
    if _conv_padding(conv) is None:
        return "conv.padding='same' with an even dilated kernel pads asymmetrically; not supported"
    if not bn.affine:
        return "bn.affine=False is not supported (BatchNorm2d without weight and bias)"
    if not bn.track_running_stats:
        return "bn.track_running_stats=False is not supported (BatchNorm2d without running statistics)"
    if bn.num_features != conv.out_channels:
        return f"bn.num_features={bn.num_features} does not match conv.out_channels={conv.out_channels}"
    if maxpool is not None:
        if _pair(maxpool.dilation) != (1, 1):
            return f"maxpool.dilation={maxpool.dilation} is not supported (only 1)"
        if maxpool.ceil_mode:
            return "maxpool.ceil_mode=True is not supported"
        if maxpool.return_indices:
            return "maxpool.return_indices=True is not supported"
        kh, kw = _pair(maxpool.kernel_size)
        if kh * kw > 255:  # cells 0..kh*kw-1 plus the sentinel kh*kw must fit a uint8
            return f"maxpool.kernel_size={maxpool.kernel_size} has more than 255 cells (uint8 window index)"
        ph, pw = _pair(maxpool.padding)
        if 2 * ph > kh or 2 * pw > kw:
            return f"maxpool.padding={maxpool.padding} must be at most half of kernel_size={maxpool.kernel_size}"
    return ""


def _pool_spec(maxpool: nn.MaxPool2d | None) -> PoolSpec | None:
    if maxpool is None:
        return None
    stride = maxpool.stride if maxpool.stride not in (None, ()) else maxpool.kernel_size
    return PoolSpec(_pair(maxpool.kernel_size), _pair(stride), _pair(maxpool.padding))


def _internal(t: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """With a pool, CPU tensors run channels-last inside the op: aten's CPU max-pool is ~50x faster there
    (3/2 pool on the stem's 8x64x112x112: 3 ms vs 180 ms) and batch-norm forward ~3x, which pays for the
    layout copies. Without a pool the copies of a full-size output and gradient would cost more than the
    batch-norm gains, so the input's own layout is kept."""
    if not cfg.channels_last or t.device.type != "cpu":
        return t
    return t.contiguous(memory_format=torch.channels_last)


def _like_input(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The output in the layout eager gives for ``x``: channels-last only for a channels-last input."""
    if out.device.type != "cpu":
        return out
    cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return out.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


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
    def forward(ctx, x, weight, bias, bn_weight, bn_bias, running_mean, running_var, cfg: _Config):
        ctx.cfg, ctx.has_bias = cfg, bias is not None
        if cfg.training:
            y = F.conv2d(_internal(x, cfg), weight, bias, *cfg.conv_args(), cfg.groups)
            ctx.empty = y.numel() == 0
            if ctx.empty:  # as nn.BatchNorm2d: empty output, running statistics untouched
                ctx.save_for_backward(x, weight)
                return _empty_output(y, cfg.pool)
            out, mean, invstd, idx = bn_act_forward(y, bn_weight, bn_bias, running_mean, running_var,
                                                    training=True, momentum=cfg.momentum, eps=cfg.eps,
                                                    act=cfg.act, pool=cfg.pool)
            # recompute: backward runs the same conv on the same input (the same bits), so y is not kept
            ctx.save_for_backward(x, weight, bias if cfg.recompute else None, bn_weight, bn_bias,
                                  None if cfg.recompute else y, mean, invstd, idx)
            return _like_input(out, x)
        # folded in fp32 for fp32/bf16/fp16 inputs, in fp64 for fp64 ones (fp32 would cost fp64 ~1e-8 relative)
        acc = acc_dtype(x.dtype)
        mean = running_mean.detach().clone()
        invstd = torch.rsqrt(running_var.to(acc) + cfg.eps)
        fold = bn_weight.to(acc) * invstd
        w_f = (weight.to(acc) * fold.view(-1, 1, 1, 1)).to(weight.dtype)
        b0 = mean.to(acc).neg() if bias is None else bias.to(acc) - mean.to(acc)
        a = F.conv2d(_internal(x, cfg), w_f, (b0 * fold + bn_bias.to(acc)).to(x.dtype), *cfg.conv_args(), cfg.groups)
        ctx.empty = a.numel() == 0
        if ctx.empty:
            ctx.save_for_backward(x, weight)
            return _empty_output(a, cfg.pool)
        out, _, _, idx = bn_act_forward(a, None, None, None, None, training=False, momentum=0.0,
                                        eps=cfg.eps, act=cfg.act, pool=cfg.pool)
        ctx.in_shape = tuple(a.shape)
        keep_a = cfg.pool is None or not cfg.act.has_dead_zone
        ctx.save_for_backward(x, weight, bn_weight, a if keep_a else None, b0, invstd, idx)
        return _like_input(out, x)

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


def _empty_output(y: torch.Tensor, pool: PoolSpec | None) -> torch.Tensor:
    if pool is None:
        return y.new_empty(y.shape)
    return y.new_empty(*y.shape[:2], *pool.out_size(*y.shape[-2:]))


def _empty_grads(ctx, x, weight):
    """Gradients of an empty batch: zeros for every parameter, as eager autograd gives."""
    need = ctx.needs_input_grad
    c = weight.shape[0]
    zeros = lambda ok: weight.new_zeros(c) if ok else None
    return (_zeros_like_or_none(x, need[0]), _zeros_like_or_none(weight, need[1]),
            zeros(need[2] and ctx.has_bias), zeros(need[3]), zeros(need[4]), None, None, None)


def _conv_backward(ctx, grad_y, x, weight, need_w):
    cfg, need = ctx.cfg, ctx.needs_input_grad
    # [0] without a bias: the same call autograd makes for the eager conv, so ATen picks the same kernels
    bias_sizes = [weight.shape[0]] if ctx.has_bias else [0]
    return convolution_backward(grad_y, x, weight, bias_sizes, *cfg.conv_args(), cfg.groups,
                                [need[0], need_w, need[2] and ctx.has_bias])


def _backward_train(ctx, grad_out):
    x, weight, bias, bn_weight, bn_bias, y, mean, invstd, idx = ctx.saved_tensors
    cfg, need = ctx.cfg, ctx.needs_input_grad
    if y is None:
        y = F.conv2d(_internal(x, cfg), weight, bias, *cfg.conv_args(), cfg.groups)
    grad_y, grad_gamma, grad_beta = bn_act_backward(
        grad_out, y, bn_weight, bn_bias, mean, invstd, idx, training=True, eps=cfg.eps, act=cfg.act,
        pool=cfg.pool, output_mask=(True, need[3], need[4]))
    dx, dw, db = _conv_backward(ctx, grad_y, _internal(x, ctx.cfg), weight, need[1])
    return dx, dw, db, grad_gamma, grad_beta, None, None, None


def _backward_eval(ctx, grad_out):
    """Gradients through the folded conv: w_f = w * s, b_f = (b - mean) * s + beta, s = gamma * invstd."""
    x, weight, bn_weight, a, b0, invstd, idx = ctx.saved_tensors
    cfg, need = ctx.cfg, ctx.needs_input_grad
    acc = invstd.dtype  # the forward's acc_dtype(x.dtype)
    fold = bn_weight.to(acc) * invstd
    w_f = (weight.to(acc) * fold.view(-1, 1, 1, 1)).to(weight.dtype)
    grad_a, _, _ = bn_act_backward(grad_out, a, None, None, None, None, idx, training=False, eps=cfg.eps,
                                   act=cfg.act, pool=cfg.pool, in_shape=ctx.in_shape,
                                   output_mask=(True, False, False))
    need_wf = need[1] or need[3]
    bias_sizes = [weight.shape[0]]
    dx, dw_f, db_f = convolution_backward(grad_a, _internal(x, cfg), w_f, bias_sizes, *cfg.conv_args(), cfg.groups,
                                          [need[0], need_wf, True])
    db_f = db_f.to(acc)
    dw = (dw_f.to(acc) * fold.view(-1, 1, 1, 1)).to(weight.dtype) if need[1] else None
    db = (db_f * fold).to(weight.dtype) if need[2] and ctx.has_bias else None
    dgamma = None
    if need[3]:
        dfold = (dw_f.to(acc) * weight.to(acc)).sum((1, 2, 3)) + db_f * b0
        dgamma = (dfold * invstd).to(bn_weight.dtype)
    dbeta = db_f.to(bn_weight.dtype) if need[4] else None
    return dx, dw, db, dgamma, dbeta, None, None, None


ConvBNReLUFunction = ConvBNActFunction  # the name the ReLU-only op had; same Function


class FusedConvBNAct(nn.Module):
    """Drop-in for ``nn.Sequential(conv, bn, act[, maxpool])`` that keeps a fraction of the activations.

    The contract a graph rewrite uses (``conv_bn_<act>[_maxpool]`` patterns):

    * ``supports(conv, bn, act, maxpool=None) -> (ok, reason)`` never raises; ``reason`` names the first
      unsupported argument or attribute (``conv``, ``bn``, ``act``, ``maxpool``, e.g. ``"conv.padding_mode=
      'reflect' is not supported"``). ``from_modules`` with the same arguments raises TypeError for a module
      of the wrong kind and ValueError for a supported kind with unsupported settings, with that reason.
    * ``conv``: exactly ``nn.Conv2d``, any ``groups`` (grouped, depthwise), stride, dilation, numeric or
      ``'valid'``/``'same'`` padding (``'same'`` only where it is symmetric), ``padding_mode='zeros'``.
    * ``bn``: ``nn.BatchNorm2d`` with ``affine`` and ``track_running_stats``, ``num_features ==
      conv.out_channels``; any ``momentum`` (None: cumulative average), any ``eps``. A subclass with its own
      forward is taken when that forward computes ``act(BatchNorm2d(x))`` with ``act`` its child (timm's
      ``BatchNormAct2d``; the fused op then replaces the BatchNorm and its activation), or BatchNorm2d alone
      when it has no child besides ``nn.Identity`` ones: checked on a probe (``ops/_bn_act.py``).
    * ``act``: ``nn.ReLU``, ``nn.ReLU6``, ``nn.LeakyReLU`` (any ``negative_slope``), ``nn.SiLU``,
      ``nn.Hardswish``, ``nn.GELU`` (``approximate`` ``'none'`` or ``'tanh'``), or the Hugging Face
      ``ACT2FN`` modules ``GELUActivation``, ``NewGELUActivation``, ``FastGELUActivation``, ``GELUTanh``,
      ``PytorchGELUTanh``, ``AccurateGELUActivation``, ``SiLUActivation`` (matched by class name and
      checked on a probe tensor; transformers is not imported). ``self.act_spec`` is the resolved
      :class:`~opsnn_lab.kernels.bn_act.Act` (its ``name`` is the pattern's ``<act>``). ``inplace`` is
      irrelevant: the activation's input is never exposed.
    * ``maxpool``: None or exactly ``nn.MaxPool2d`` with dilation 1, ``ceil_mode=False``,
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

    ``recompute``: None (default) recomputes the conv output in backward, in training, for a stride-1
    depthwise conv and saves it otherwise; True / False always recompute / save it (the same bits either way).

    Saved for backward: the conv input, the conv output (unless recomputed from the input), two fp32 values
    per channel, and with a pool one uint8 per pooled element; the BN
    output and the activation's output are recomputed. Empty batch:
    behaves as eager (empty output, running stats unchanged, ``num_batches_tracked`` + 1, zero parameter
    gradients). One value per channel in training raises ValueError, as eager does.
    """

    _act_attr = "act"  # the submodule name of the activation
    _relu_only = False

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: nn.Module, maxpool: nn.MaxPool2d | None = None,
                 *, register_modules: bool = True, recompute: bool | None = None):
        super().__init__()
        check_type("register_modules", register_modules, bool)
        self.recompute = check_type("recompute", recompute, bool, allow_none=True)
        wrong = _wrong_type(conv, bn, act, maxpool, self._act_attr, self._relu_only)
        if wrong:
            raise TypeError(wrong)
        reason = _why_not(conv, bn, act, maxpool, self._act_attr, self._relu_only)
        if reason:
            raise ValueError(reason)
        self.register_modules = register_modules
        self.act_spec = activation_of(act)[0]
        setter = nn.Module.__setattr__ if register_modules else object.__setattr__
        for name, mod in (("conv", conv), ("bn", bn), (self._act_attr, act), ("maxpool", maxpool)):
            setter(self, name, mod)
        self.pool = _pool_spec(maxpool)
        self.train(conv.training)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: nn.Module, maxpool: nn.MaxPool2d | None = None,
                     *, register_modules: bool = True, recompute: bool | None = None):
        """Fuse existing modules, sharing their Parameter and buffer objects (see the class docstring)."""
        return cls(conv, bn, act, maxpool, register_modules=register_modules, recompute=recompute)

    @classmethod
    def supports(cls, conv, bn, act, maxpool=None) -> tuple[bool, str]:
        """``(True, '')`` when the chain can be fused, else ``(False, reason)`` naming the argument."""
        reason = _why_not(conv, bn, act, maxpool, cls._act_attr, cls._relu_only)
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
        stride = _pair(conv.stride)
        recompute = self.recompute
        if recompute is None:
            recompute = conv.groups > 1 and conv.groups == conv.in_channels and stride == (1, 1)
        channels_last = self.pool is not None and not torch.are_deterministic_algorithms_enabled()
        return _Config(stride, _conv_padding(conv), _pair(conv.dilation), conv.groups, bn.eps, self.training,
                       factor, self.pool, self.act_spec, recompute=self.training and recompute,
                       channels_last=channels_last)

    def _check_input(self, x, w) -> None:
        check_tensor("input", x, dtypes=_FLOATS, dim=4)
        if x.shape[1] != self.conv.in_channels:
            raise ValueError(f"input must have {self.conv.in_channels} channels (dim 1), got shape {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match conv.weight dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"input is on {x.device} but conv.weight is on {w.device}")
        if self.training and x.shape[0] == 1 and x.numel() and self._conv_plane(x) == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input of shape "
                             f"{tuple(x.shape)} (one conv output value per channel)")

    def _conv_plane(self, x) -> int:
        (ph, pw), (kh, kw) = _conv_padding(self.conv), self.conv.kernel_size
        (sh, sw), (dh, dw) = _pair(self.conv.stride), _pair(self.conv.dilation)
        oh = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        ow = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        return oh * ow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, bn = self.conv, self.bn
        with _amp.region(x) as cast:  # under autocast: the conv's operands cast, BN's parameters and statistics not
            x, weight, bias = cast(x, conv.weight, conv.bias)
            self._check_input(x, weight)
            return ConvBNActFunction.apply(x, weight, bias, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                           self._config())

    def extra_repr(self) -> str:
        pool = "" if self.pool is None else f", pool={self.pool}"
        recompute = "" if self.recompute is None else f", recompute={self.recompute}"
        return f"act={self.act_spec}, register_modules={self.register_modules}{pool}{recompute}"


class FusedConvBNReLU(FusedConvBNAct):
    """:class:`FusedConvBNAct` restricted to ``nn.ReLU`` (submodule ``relu``): ``from_modules(conv, bn, relu,
    maxpool=None, register_modules=True)``; any other activation is a TypeError naming ``relu``."""

    _act_attr = "relu"
    _relu_only = True

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.Module, maxpool: nn.MaxPool2d | None = None,
                 *, register_modules: bool = True, recompute: bool | None = None):
        super().__init__(conv, bn, relu, maxpool, register_modules=register_modules, recompute=recompute)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.Module, maxpool: nn.MaxPool2d | None = None,
                     *, register_modules: bool = True, recompute: bool | None = None) -> FusedConvBNReLU:
        """Fuse existing modules, sharing their Parameter and buffer objects (see :class:`FusedConvBNAct`)."""
        return cls(conv, bn, relu, maxpool, register_modules=register_modules, recompute=recompute)

    @classmethod
    def supports(cls, conv, bn, relu, maxpool=None) -> tuple[bool, str]:
        """``(True, '')`` when the chain can be fused, else ``(False, reason)`` naming the argument."""
        return super().supports(conv, bn, relu, maxpool)
