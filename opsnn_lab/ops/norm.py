"""LayerNorm and RMSNorm, alone or with the residual add before them, as single autograd ops.

What is saved for backward, per row of ``N`` features (``s`` = the input, or ``x + residual``; ``y`` the output):

=========================================  ======================================  ==================
chain                                       eager saves                             fused saves
=========================================  ======================================  ==================
``nn.LayerNorm``                            s, mean, rstd                           y, rstd
``nn.RMSNorm`` / HF ``*RMSNorm``            s (fp32 copy), s * rstd, rstd, ...       y, rstd
norm -> Linear (what a transformer does)    the above + y (the Linear's input)      y, rstd (y once)
=========================================  ======================================  ==================

The fused ops save their OUTPUT and recover ``xhat = (y - bias) / weight`` in backward
(``kernels.norm.norm_bwd_from_output``). Alone that saves nothing; but the op after a norm (a Linear: the
QKV projection, the MLP's first Linear, Llama's q/k/v and gate/up projections) saves ``y`` anyway, so the
norm's input is no longer stored at all. Recovery is exact up to ``y``'s rounding divided by the weight, so it
is used only where ``kernels.norm.output_recoverable`` says the parameters allow it (no zero or near-zero
effective weight, ``|bias| <= 4 |weight|``), decided at run time, once per parameter version; otherwise the
op saves its input as before. ``save_output=False`` (or ``module.save_output = False``) always saves the
input: the choice for a norm whose output nothing else keeps, where saving ``y`` gains no bytes and
LayerNorm's recovery costs time (on the torch path a LayerNorm alone saving its output takes ~1.5x eager's
step; the rewrite fuses a LayerNorm only where the next op keeps its output). An fp32/fp64 LayerNorm saving its
input is then aten's ``layer_norm``, on CPU and CUDA: eager's kernels and bits. Autograd refuses an in-place
change of a saved ``y`` (as it refuses one of the saved sum), never giving wrong gradients.

The fused ops compute the statistics and the output in fp32 and round once to the input dtype (HF's
Llama rounds before the weight multiply; the fused result is the more accurate of the two). Under
``torch.autocast`` nothing is cast (autocast leaves an fp32 residual stream's norms in fp32) and autocast is
off inside; the add ops widen a bf16 ``x`` onto an fp32 ``residual`` first, as eager's add does.

Contract for the fusion rewrite (``supports`` says yes or gives the reason; ``from_modules`` raises
``ValueError`` with that reason): ``FusedLayerNorm`` takes an ``nn.LayerNorm``; ``FusedRMSNorm`` takes an
``nn.RMSNorm`` or a Hugging Face ``*RMSNorm`` (``weight`` plus ``variance_epsilon`` or ``eps``; Gemma's
``(1 + weight)`` form is detected from its source and handled with ``weight_offset=1.0``). The fused module
registers the original ``weight``/``bias`` Parameter objects, so ``state_dict`` keys and values are unchanged.
``FusedAddLayerNorm`` / ``FusedAddRMSNorm`` take the same modules; their ``forward(x, residual)`` returns
``(normed, summed)``: the normalised output and ``x + residual``, which the residual stream continues with
(out of place, ``h = summed + ...``: when the op falls back to saving the sum, autograd refuses in-place
updates of it).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_tensor, check_type, first_derivative_only, same_device
from opsnn_lab.kernels._dispatch import forced_backend
from opsnn_lab.kernels.norm import norm_bwd, norm_bwd_from_output, norm_fwd, output_recoverable, uses_triton
from opsnn_lab.ops import _amp

__all__ = ["AddNormFunction", "FusedLayerNorm", "FusedRMSNorm", "FusedAddLayerNorm", "FusedAddRMSNorm",
           "rms_norm_form"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ATEN_EXACT = (torch.float32, torch.float64)  # bf16/fp16: the fused op keeps fp32 statistics and gradient sums


class AddNormFunction(torch.autograd.Function):
    """``y = norm(x [+ residual])``. ``save_output=False``: saves ``s`` (the input or the sum) and fp32 ``rstd``
    (and ``mean``); ``True``: saves ``y`` and ``rstd`` and recovers ``xhat`` from ``y`` in backward (the caller
    has checked ``output_recoverable``); ``y`` is what the next op saves anyway, so it is stored once."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, residual, weight, bias, eps, rms, weight_offset, save_output=False):
        # x, residual: (..., N), normalised over the last dim. y and the sum come back in x's shape as made, never
        # as views: an in-place change of a custom Function's view output is refused, and views made outside
        # (x.reshape(-1, N) before, out.view(x.shape) after) would put two more nodes on the autograd graph
        y, s, mean, rstd = norm_fwd(x, weight, bias, residual, eps, rms, weight_offset, check=False)
        ctx.cfg = (rms, weight_offset, bias is not None, residual is not None, save_output)
        ctx.save_for_backward(y if save_output else s, None if save_output else mean, rstd, weight, bias)
        ctx.set_materialize_grads(False)
        return y if residual is None else (y, s)

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad_y, grad_sum=None):
        first_derivative_only("the fused norm")
        saved, mean, rstd, weight, bias = ctx.saved_tensors
        rms, weight_offset, has_bias, has_residual, from_output = ctx.cfg
        need_x, need_r, need_w, need_b = ctx.needs_input_grad[:4]
        shape, n = saved.shape, saved.shape[-1]
        saved = saved.reshape(-1, n)
        gy = torch.zeros_like(saved) if grad_y is None else grad_y.reshape(-1, n).to(saved.dtype)
        gs = None if grad_sum is None else grad_sum.reshape(-1, n).to(saved.dtype)
        if from_output:
            grad_s, grad_w, grad_b = norm_bwd_from_output(gy, saved, rstd, weight, bias, rms, weight_offset,
                                                          want_weight=need_w, want_bias=need_b, grad_sum=gs,
                                                          check=False)
        else:
            grad_s, grad_w, grad_b = norm_bwd(gy, saved, mean, rstd, weight, rms, weight_offset, has_bias and need_b,
                                              gs, want_weight=need_w, bias=bias, check=False)
        grad_s = grad_s.view(shape)
        return (grad_s if need_x else None, grad_s if has_residual and need_r else None,
                grad_w if need_w else None, grad_b if need_b else None, None, None, None, None)


# --------------------------------------------------------------------------- what can be fused
def _eps_of(module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return float(eps)
    return None


def rms_norm_form(module: nn.Module) -> tuple[float | None, str]:
    """``(weight_offset, reason)`` for an RMSNorm-like module: offset 0.0 (``weight * xhat``), 1.0 (Gemma's
    ``(1 + weight) * xhat``) or None with the reason it cannot be fused."""
    if isinstance(module, nn.RMSNorm):
        return 0.0, "nn.RMSNorm"
    name = type(module).__name__
    if not name.endswith("RMSNorm"):
        return None, f"{name} is neither nn.RMSNorm nor a Hugging Face *RMSNorm"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None, f"{name} has no 1-D weight Parameter"
    if getattr(module, "bias", None) is not None:
        return None, f"{name} has a bias; RMSNorm with a bias is not a known form"
    if _eps_of(module) is None:
        return None, f"{name} has neither variance_epsilon nor eps"
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(params) != 1:
        return None, f"{name}.forward takes {len(params)} required inputs (a gated norm?); only one is fused"
    try:
        src = inspect.getsource(type(module))
    except (OSError, TypeError):
        return None, f"{name}: source unavailable, so its weight form cannot be checked"
    compact = src.replace(" ", "")
    if "rsqrt" not in compact or "mean(-1" not in compact or "pow(2)" not in compact:
        return None, f"{name}: forward is not pow(2).mean(-1) -> rsqrt, the RMSNorm form"
    if "(1.0+self.weight" in compact or "(1+self.weight" in compact:
        return 1.0, f"{name}: (1 + weight) form"
    if "self.weight*" in compact or "*self.weight" in compact:
        return 0.0, f"{name}: weight * xhat form"
    return None, f"{name}: the weight's use is not weight * xhat nor (1 + weight) * xhat"


def _layer_norm_support(module) -> tuple[bool, str]:
    if not isinstance(module, nn.LayerNorm):
        return False, f"expected nn.LayerNorm, got {type(module).__name__}"
    if type(module).forward is not nn.LayerNorm.forward:
        # timm's LayerNorm2d subclasses nn.LayerNorm and normalises the channels: its class says nothing of that
        return False, (f"{type(module).__name__} overrides nn.LayerNorm.forward, so what it computes is not known "
                       "here; ol.fusion.fuse checks it on its input (a norm over the channels becomes "
                       "FusedLayerNorm(..., channel_dim=1))")
    return True, "nn.LayerNorm over the last dims"


def _rms_norm_support(module) -> tuple[bool, str]:
    offset, reason = rms_norm_form(module)
    return offset is not None, reason


# --------------------------------------------------------------------------- modules
class _FusedNorm(nn.Module):
    _rms = False
    _add = False

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None = None, eps: float = 1e-5,
                 normalized_shape: tuple[int, ...] | None = None, weight_offset: float = 0.0, save_output: bool = True,
                 cast_params: bool = False, channel_dim: int | None = None):
        super().__init__()
        check_type("weight", weight, nn.Parameter, allow_none=True)
        check_type("save_output", save_output, bool)
        # True: weight and bias take the input's dtype at each call, as a norm written in Python that casts them does
        # (diffusers' FP32LayerNorm: ``F.layer_norm(x.float(), ..., weight.float(), bias.float())`` in a bf16 model);
        # their gradients flow back through the cast, into their own dtype
        self.cast_params = check_type("cast_params", cast_params, bool)
        check_type("bias", bias, nn.Parameter, allow_none=True)
        check_type("eps", eps, (int, float))
        if eps < 0 or isinstance(eps, bool):
            raise ValueError(f"eps must be >= 0, got {eps}")
        if normalized_shape is None:
            if weight is None:
                raise ValueError("normalized_shape is required when weight is None")
            normalized_shape = tuple(weight.shape)
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and tuple(p.shape) != self.normalized_shape:
                raise ValueError(f"{name} must have shape {self.normalized_shape}, got {tuple(p.shape)}")
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.eps = float(eps)
        self.weight_offset = float(check_type("weight_offset", weight_offset, (int, float)))
        # False: always save the input: where nothing else keeps the output (saving it gains no bytes there, and
        # LayerNorm's recovery costs time) or where the output is modified in place
        self.save_output = save_output
        # 1: the norm is over dim 1 of an (N, C, *) input (timm's LayerNorm2d / RmsNorm2d): the op runs on the
        # channels-last view and returns its result viewed back, an (N, C, *) tensor with channels-last strides as
        # the permute -> layer_norm -> permute the module computes gives
        if channel_dim is not None and (channel_dim != 1 or len(self.normalized_shape) != 1):
            raise ValueError(f"channel_dim must be None or 1 (with a 1-D normalized_shape), got {channel_dim!r}")
        if channel_dim is not None and self._add:
            raise ValueError("channel_dim: the add-and-norm ops normalise over the last dim only")
        self.channel_dim = channel_dim
        self._recoverable_key, self._recoverable = None, False

    def _saves_output(self, dtype) -> bool:
        """Run-time choice: save ``y`` when ``output_recoverable`` (checked once per parameter version)."""
        if not self.save_output or not torch.is_grad_enabled():
            return False
        w, b = self.weight, self.bias
        key = (dtype, None if w is None else w.data_ptr(), None if w is None else w._version,
               None if b is None else b.data_ptr(), None if b is None else b._version)
        if key != self._recoverable_key:
            self._recoverable_key = key
            self._recoverable = output_recoverable(self.weight, self.bias, self.weight_offset, dtype)
        return self._recoverable

    @property
    def features(self) -> int:
        return math.prod(self.normalized_shape)

    def defers_under_autocast(self, x: torch.Tensor) -> bool:
        """Under autocast, x's dtype is not the weight's: the norm module being replaced decides the output dtype
        there (HF RMSNorms return fp32, nn.LayerNorm x's dtype on CPU and fp32 on CUDA), so a rewrite runs it."""
        return self.weight is not None and x.dtype != self.weight.dtype and _amp.autocast_dtype(x) is not None

    def _flat(self, p):
        # 1-D parameters go in as they are: a view would add a ViewBackward copy of each gradient
        return p if p is None or p.dim() == 1 else p.view(-1)

    def _check(self, x, name="x"):
        if self.__dict__.get("channel_dim"):
            check_tensor(name, x, dtypes=_FLOATS, min_dim=2)
            if x.shape[1] != self.normalized_shape[0]:
                raise ValueError(f"{name} must have {self.normalized_shape[0]} channels in dim 1, got shape "
                                 f"{tuple(x.shape)}")
        else:
            check_tensor(name, x, dtypes=_FLOATS, min_dim=1)
            k = len(self.normalized_shape)
            if tuple(x.shape[x.dim() - k:]) != self.normalized_shape:
                raise ValueError(f"{name} must end with {self.normalized_shape}, got shape {tuple(x.shape)}")
        same_device(weight=self.weight, **{name: x})

    def _params(self, dtype: torch.dtype):
        """``(weight, bias)`` as the op reads them: cast to ``dtype`` where ``cast_params`` says so."""
        w, b = self.weight, self.bias
        if self.__dict__.get("cast_params", False):  # a module pickled before this option: False
            w, b = (p if p is None or p.dtype == dtype else p.to(dtype) for p in (w, b))
        return w, b

    def _apply_norm(self, x, residual, autocast: torch.dtype | None = None):
        # saving y pays because the op reading it saves the same tensor; under autocast a Linear reading an fp32
        # y saves its own bf16 copy instead, so y is saved only where it already is autocast's dtype
        keep_y = autocast in (None, x.dtype) and self._saves_output(x.dtype)
        weight, bias = self._params(x.dtype)
        if (not keep_y and not self._rms and not self.weight_offset and x.dtype in _ATEN_EXACT
                and (not uses_triton(x) or forced_backend() != "triton")):
            # saving its input, an fp32/fp64 LayerNorm is aten's, on CPU and CUDA alike: run it through aten's own
            # autograd node (eager's kernels and bits; on CPU without the Function's Python, ~0.2 ms a step; on
            # CUDA without the Triton launches, which took the H200's step to 3.3x eager's wall time). Only
            # OPSNN_BACKEND=triton keeps the kernels here (their tests)
            s = x if residual is None else x + residual
            y = F.layer_norm(s, self.normalized_shape, weight, bias, self.eps)
            return y if residual is None else (y, s)
        if len(self.normalized_shape) == 1:  # the Function returns x's shape
            return AddNormFunction.apply(x, residual, weight, bias, self.eps, self._rms, self.weight_offset, keep_y)
        lead = x.shape[:x.dim() - len(self.normalized_shape)]
        flat = x.reshape(*lead, self.features)
        res = None if residual is None else residual.reshape(*lead, self.features)
        out = AddNormFunction.apply(flat, res, self._flat(weight), self._flat(bias), self.eps, self._rms,
                                    self.weight_offset, keep_y)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def extra_repr(self) -> str:
        extra = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        extra += ", cast_params=True" if self.__dict__.get("cast_params", False) else ""
        extra += f", channel_dim={self.channel_dim}" if self.__dict__.get("channel_dim") else ""
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}{extra}"


class _NormForward(_FusedNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        autocast = _amp.autocast_dtype(x)
        channels_first = self.__dict__.get("channel_dim")  # a module pickled before this option: None
        with _amp.region(x):  # under autocast: nothing cast (norms run in their input's dtype), autocast off inside
            if channels_first:
                return self._apply_norm(x.movedim(1, -1), None, autocast).movedim(-1, 1)
            return self._apply_norm(x, None, autocast)


class _AddNormForward(_FusedNorm):
    _add = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""
        self._check(x)
        self._check(residual, "residual")
        autocast = _amp.autocast_dtype(x)
        if autocast is not None and residual.dtype != x.dtype:
            # under autocast a bf16 sublayer output meets an fp32 residual stream: eager's add widens
            wide = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(wide), residual.to(wide)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x's shape and dtype {tuple(x.shape)}/{x.dtype}, got "
                             f"{tuple(residual.shape)}/{residual.dtype}")
        with _amp.region(x):
            return self._apply_norm(x, residual, autocast)


class _LayerNormFactory:
    @classmethod
    def supports(cls, norm: nn.Module) -> tuple[bool, str]:
        """``(True, why)`` when ``from_modules(norm)`` will fuse it, else ``(False, reason)``."""
        return _layer_norm_support(norm)

    @classmethod
    def from_modules(cls, norm: nn.LayerNorm, save_output: bool = True):
        ok, reason = cls.supports(norm)
        if not ok:
            raise ValueError(f"norm: {reason}")
        return cls(norm.weight, norm.bias, norm.eps, tuple(norm.normalized_shape),
                   save_output=save_output).train(norm.training)


class _RMSNormFactory:
    @classmethod
    def supports(cls, norm: nn.Module) -> tuple[bool, str]:
        """``(True, form)`` for ``nn.RMSNorm`` and HF ``*RMSNorm`` modules it can fuse, else ``(False, reason)``."""
        return _rms_norm_support(norm)

    @classmethod
    def from_modules(cls, norm: nn.Module, save_output: bool = True):
        offset, reason = rms_norm_form(norm)
        if offset is None:
            raise ValueError(f"norm: {reason}")
        eps = _eps_of(norm)
        if isinstance(norm, nn.RMSNorm):
            if eps is None:  # nn.RMSNorm's default: the input dtype's machine epsilon
                dtype = norm.weight.dtype if norm.weight is not None else torch.get_default_dtype()
                eps = torch.finfo(dtype).eps
            fused = cls(norm.weight, None, eps, tuple(norm.normalized_shape), save_output=save_output)
        else:
            fused = cls(norm.weight, None, eps, weight_offset=offset, save_output=save_output)
        return fused.train(norm.training)


class FusedLayerNorm(_LayerNormFactory, _NormForward):
    """``nn.LayerNorm`` in one op; saves the output and rstd per row (the input, mean, rstd if unrecoverable)."""


class FusedAddLayerNorm(_LayerNormFactory, _AddNormForward):
    """``s = x + residual; y = LayerNorm(s)`` in one op; returns ``(y, s)``; saves y and rstd (or s, mean, rstd)."""


class FusedRMSNorm(_RMSNormFactory, _NormForward):
    """``nn.RMSNorm`` or a HF ``*RMSNorm`` in one op; saves the output (or the input) and fp32 rstd per row."""

    _rms = True


class FusedAddRMSNorm(_RMSNormFactory, _AddNormForward):
    """``s = x + residual; y = RMSNorm(s)`` in one op; returns ``(y, s)``; saves y (or s) and rstd per row."""

    _rms = True
