"""Linear -> activation [-> Dropout] [-> Linear] as single autograd ops, for nn.Linear and Hugging Face Conv1D.

Activations: ``gelu``, ``gelu_tanh`` (GPT-2's ``gelu_new``, ``gelu_pytorch_tanh``), ``quick_gelu`` (CLIP),
``silu``, ``relu`` -- torch modules or Hugging Face ``ACT2FN`` modules, see ``_mlp_parts``.

What is saved for backward (fp32, BERT-base MLP, 1024 tokens, 768 -> 3072 -> 768, dropout 0.1, CPU):

============================  ==============================================  =================
eager                         x, h (GELU input), fp32 dropout noise, drop out  40.9 MB
fused (default)               x, h; mask regenerated, GELU recomputed          15.7 MB (0.385)
fused, ``recompute=True``     x only; h recomputed by one more GEMM            3.1 MB (0.077)
============================  ==============================================  =================

(On CUDA eager's dropout mask is a bool tensor: 31.5 MB, so the default ratio is 0.50 there.)
``recompute=True`` trades one extra ``tokens x in x out`` GEMM in backward for the pre-activation.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import check_choice, check_range, check_tensor, check_type, first_derivative_only, same_device
from opsnn_lab.kernels import backend_for
from opsnn_lab.kernels.gelu_dropout import act_dropout_bwd, act_dropout_fwd, act_forward
from opsnn_lab.ops import _amp
from opsnn_lab.ops import _mlp_parts as parts
from opsnn_lab.ops.dropout import CounterRNG, Dropout

__all__ = [
    "FusedLinearActDropout",
    "FusedLinearActDropoutLinear",
    "FusedLinearGELUDropout",
    "FusedLinearGELUDropoutLinear",
    "LinearActDropoutFunction",
    "LinearActDropoutLinearFunction",
    "LinearGELUDropoutFunction",
    "LinearGELUDropoutLinearFunction",
]

_MAX_NUMEL = 1 << 32
_GELU_ACTS = {"gelu": "none", "gelu_tanh": "tanh"}  # activation -> nn.GELU's approximate


def _preactivation(x2, weight, bias, transposed, backend):
    """``x2 @ W + bias`` as (h, bias still to add): the Triton kernel adds the bias itself."""
    if backend == "torch":
        return parts.linear2d(x2, weight, bias, transposed), None
    return parts.linear2d(x2, weight, None, transposed), bias


def _recompute_h(x2, weight, bias, transposed, backend):
    h, late_bias = _preactivation(x2, weight, bias, transposed, backend)
    return h if late_bias is None else h.add_(late_bias)


def _forward_h(ctx, x, weight, bias, cfg):
    """Shared forward half: returns ``(out2d, h, x2)`` and stores the config on ctx."""
    p, seed, offset, act, recompute, transposed = cfg
    x2 = x.reshape(-1, x.shape[-1])
    backend = backend_for(x2)
    h, late_bias = _preactivation(x2, weight, bias, transposed, backend)
    out, h = act_dropout_fwd(h, p, seed, offset, act, bias=late_bias)
    ctx.cfg, ctx.backend, ctx.lead = cfg, backend, x.shape[:-1]
    return out, h, x2


def _unflatten(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A Function's (M, out) result viewed as ``x``'s leading dims: the view is taken outside the Function, so the
    caller may modify the output in place (``out += residual``) as it may an nn.Linear's; a view a custom
    Function returns of a tensor it made cannot be."""
    return y.view(*x.shape[:-1], y.shape[-1])


def _saved_h(ctx, x2, h, weight, bias):
    return _recompute_h(x2, weight, bias, ctx.cfg[5], ctx.backend) if h is None else h


def _grad_x(ctx, grad_h, weight, transposed):
    w = parts.in_out(weight, transposed)
    return (grad_h @ w.t()).view(*ctx.lead, w.shape[0])


class LinearActDropoutFunction(torch.autograd.Function):
    """``dropout(act(x @ W + b))``; saves x and h (or x only with ``recompute``), never the mask.

    ``apply(x, weight, bias, p, seed, offset, act, recompute, transposed)``; ``transposed`` says the weight is
    stored ``[in, out]`` (Conv1D) instead of nn.Linear's ``[out, in]``.
    """

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight, bias, p, seed, offset, act, recompute, transposed):
        out, h, x2 = _forward_h(ctx, x, weight, bias, (p, seed, offset, act, recompute, transposed))
        ctx.save_for_backward(x2, weight, bias, None if recompute else h)
        return out  # (M, out) as computed; the module views it (see _unflatten)

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("the fused Linear -> activation -> Dropout")
        x2, weight, bias, h = ctx.saved_tensors
        p, seed, offset, act, _, transposed = ctx.cfg
        h = _saved_h(ctx, x2, h, weight, bias)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h, grad_b, _ = act_dropout_bwd(grad.reshape(h.shape).to(h.dtype), h, p, seed, offset, act,
                                            want_bias=bias is not None and need_b)
        grad_x = _grad_x(ctx, grad_h, weight, transposed) if need_x else None
        grad_w = parts.grad_weight(grad_h, x2, transposed) if need_w else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class LinearActDropoutLinearFunction(torch.autograd.Function):
    """``dropout(act(x @ W1 + b1)) @ W2 + b2``; the dropout output is recomputed for W2's gradient.

    ``apply(x, weight, bias, weight2, bias2, p, seed, offset, act, recompute, transposed, transposed2)``.
    """

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight, bias, weight2, bias2, p, seed, offset, act, recompute, transposed, transposed2):
        d, h, x2 = _forward_h(ctx, x, weight, bias, (p, seed, offset, act, recompute, transposed))
        y = parts.linear2d(d, weight2, bias2, transposed2)
        ctx.transposed2 = transposed2
        ctx.save_for_backward(x2, weight, bias, weight2, bias2, None if recompute else h)
        return y  # (M, out); the module views it (see _unflatten)

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("the fused Linear -> activation -> Dropout -> Linear")
        x2, weight, bias, weight2, bias2, h = ctx.saved_tensors
        p, seed, offset, act, _, transposed = ctx.cfg
        t2 = ctx.transposed2
        need_x, need_w, need_b, need_w2, need_b2 = ctx.needs_input_grad[:5]
        w2 = parts.in_out(weight2, t2)
        gy = grad.reshape(-1, w2.shape[1]).to(weight2.dtype)
        h = _saved_h(ctx, x2, h, weight, bias)
        grad_x = grad_w = grad_b = grad_w2 = None
        if need_x or need_w or need_b:
            grad_h, grad_b, d = act_dropout_bwd(gy @ w2.t(), h, p, seed, offset, act,
                                                want_bias=bias is not None and need_b, want_out=need_w2)
            grad_x = _grad_x(ctx, grad_h, weight, transposed) if need_x else None
            grad_w = parts.grad_weight(grad_h, x2, transposed) if need_w else None
        elif need_w2:
            d, _ = act_dropout_fwd(h, p, seed, offset, act)
        if need_w2:
            grad_w2 = parts.grad_weight(gy, d, t2)
        grad_b2 = gy.sum(0) if bias2 is not None and need_b2 else None
        return grad_x, grad_w, grad_b, grad_w2, grad_b2, None, None, None, None, None, None, None


LinearGELUDropoutFunction = LinearActDropoutFunction  # earlier names of the same Functions
LinearGELUDropoutLinearFunction = LinearActDropoutLinearFunction


# --------------------------------------------------------------------------- recognising modules
def _dropout_seed(dropout, seed):
    # Carry the stream of an already counter-based Dropout unless a seed is given explicitly.
    return dropout.rng_seed if seed is None and isinstance(dropout, Dropout) else seed


def _check_input(x, weight, in_features, name="x"):
    check_tensor(name, x, min_dim=1)
    if x.shape[-1] != in_features:
        raise ValueError(f"{name} must have {in_features} features in its last dim, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the weight is {weight.dtype}; cast one of them")
    same_device(weight=weight, **{name: x})
    if x.numel() // max(x.shape[-1], 1) * weight.numel() // max(in_features, 1) > _MAX_NUMEL:
        raise ValueError(f"{name} gives more than 2**32 activations; split the batch")


class _FusedActBase(CounterRNG, nn.Module):
    def _setup(self, weight, bias, p, act, seed, recompute, transposed):
        check_type("weight", weight, nn.Parameter)
        check_type("bias", bias, nn.Parameter, allow_none=True)
        check_tensor("weight", weight, dim=2)
        self.weight = weight
        self.register_parameter("bias", bias)
        self.p = float(check_range("p", p, 0.0, 1.0))
        self.act = check_choice("act", act, parts.ACTS)
        self.recompute = bool(check_type("recompute", recompute, bool))
        self.transposed = bool(check_type("transposed", transposed, bool))
        self._init_rng(seed)

    @property
    def in_features(self) -> int:
        return parts.features(self.weight, self.transposed)[0]

    @property
    def hidden_features(self) -> int:
        return parts.features(self.weight, self.transposed)[1]

    def _first(self, x, weight, bias):
        return act_forward(parts.linear2d(x.reshape(-1, x.shape[-1]), weight, bias, self.transposed),
                           self.act).view(*x.shape[:-1], self.hidden_features)

    def _draw(self, x):
        if not self.training:  # eval with grad (a Dropout switched off in a training model): no draw, no mask
            return 0.0, 0, 0, self.act, self.recompute, self.transposed
        seed, offset = self.next_draw(x)
        return self.p, seed, offset, self.act, self.recompute, self.transposed


class FusedLinearActDropout(_FusedActBase):
    """``Dropout(act(Linear(x)))`` in one autograd op; ``act`` in gelu, gelu_tanh, quick_gelu, silu, relu.

    Contract (``supports`` says why a set of modules does not meet it; ``from_modules`` raises TypeError /
    ValueError naming the argument for the same reasons):

    * ``linear``: ``nn.Linear`` or Hugging Face ``Conv1D`` (weight ``[in, out]``; ``transposed=True``).
    * ``act``: a parameter-free module computing one of the activations: ``nn.GELU`` (either
      ``approximate``), ``nn.SiLU``, ``nn.ReLU``, or Hugging Face ``ACT2FN`` modules (``GELUActivation``,
      ``NewGELUActivation``, ``GELUTanh``/``PytorchGELUTanh``, ``FastGELUActivation``,
      ``QuickGELUActivation``, ``SiLUActivation``); checked on a probe input, see ``_mlp_parts``.
    * ``dropout``: None, ``nn.Dropout`` or ``opsnn_lab.ops.Dropout``; counter-based here, contract of
      ``opsnn_lab.ops.dropout`` (``rng_seed``, ``rng_step``, ``set_rng``).
    * Parameters: registers the layer's own ``weight`` and ``bias`` Parameter objects (shared, no copy),
      so a rewrite that puts this module at the layer's path keeps the state_dict keys and values.
    * Saved for backward: x and the pre-activation (x only with ``recompute=True``); never a mask.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, p: float = 0.0, act: str = "gelu",
                 *, seed: int | None = None, recompute: bool = False, transposed: bool = False):
        super().__init__()
        self._setup(weight, bias, p, act, seed, recompute, transposed)

    @classmethod
    def supports(cls, linear, act, dropout=None) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(linear, act, dropout)`` would build, else ``(False, reason)``."""
        return parts.supports_of(cls._parse, linear, act, dropout)

    @classmethod
    def _parse(cls, linear, act, dropout):
        return parts.parse_chain(linear, act, dropout)

    @classmethod
    def from_modules(cls, linear: nn.Module, act: nn.Module, dropout: nn.Module | None = None, *,
                     seed: int | None = None, recompute: bool = False) -> FusedLinearActDropout:
        transposed, act_name, p, _ = cls._parse(linear, act, dropout)
        module = cls._build(linear.weight, linear.bias, p, act_name, seed=_dropout_seed(dropout, seed),
                            recompute=recompute, transposed=transposed)
        return module.train(linear.training)

    @classmethod
    def _build(cls, weight, bias, p, act, **kw):
        return cls(weight, bias, p, act, **kw)

    @property
    def out_features(self) -> int:
        return self.hidden_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _amp.region(x) as cast:  # under autocast: its matmul casts, autocast off inside
            x, weight, bias = cast(x, self.weight, self.bias)
            _check_input(x, weight, self.in_features)
            if not self.training and not torch.is_grad_enabled():  # nothing to save: plain ops
                return self._first(x, weight, bias)
            return _unflatten(LinearActDropoutFunction.apply(x, weight, bias, *self._draw(x)), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"p={self.p}, act={self.act!r}, recompute={self.recompute}, transposed={self.transposed}")


class FusedLinearActDropoutLinear(_FusedActBase):
    """``Linear2(Dropout(act(Linear1(x))))`` in one autograd op (the transformer MLP; GPT-2's c_fc/c_proj).

    Contract: as ``FusedLinearActDropout`` for ``linear1``, ``act``, ``dropout``, plus:

    * ``linear2``: ``nn.Linear`` or Conv1D with ``in_features`` = linear1's ``out_features``; dtype and device
      must match linear1's.
    * ``weight`` / ``bias`` are Linear1's own Parameter objects, registered on this module, so at Linear1's
      path the keys ``<path>.weight`` / ``<path>.bias`` are unchanged.
    * Linear2 is used by reference. With ``register_second=True`` (default) it is also a registered
      submodule ``linear2`` (keys ``linear2.weight`` / ``linear2.bias``; ``parameters()`` is complete for
      standalone use). With ``register_second=False`` it is NOT registered: the rewrite leaves the original
      Linear2 module at its own path, so its keys stay there and appear once. ``weight2`` / ``bias2`` always
      read Linear2's current Parameters.
    * Saved for backward: x and the pre-activation (x only with ``recompute=True``); the dropout output
      that Linear2's weight gradient needs is recomputed.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, linear2: nn.Module, p: float = 0.0,
                 act: str = "gelu", *, seed: int | None = None, recompute: bool = False,
                 register_second: bool = True, transposed: bool = False):
        super().__init__()
        self._setup(weight, bias, p, act, seed, recompute, transposed)
        transposed2, why = parts.linear_layout(linear2)
        if transposed2 is None:
            raise TypeError(f"linear2: {why}")
        in2 = parts.features(linear2.weight, transposed2)[0]
        if in2 != self.hidden_features:
            raise ValueError(f"linear2 must have in_features={self.hidden_features} (linear1's out_features), "
                             f"got {in2}")
        if linear2.weight.dtype != weight.dtype or linear2.weight.device != weight.device:
            raise TypeError("linear2 must have linear1's dtype and device, got "
                            f"{linear2.weight.dtype}/{linear2.weight.device} vs {weight.dtype}/{weight.device}")
        self.transposed2 = transposed2
        if check_type("register_second", register_second, bool):
            self.linear2 = linear2
        else:
            object.__setattr__(self, "_linear2_ref", linear2)

    _NAMES = ("linear1", "act", "dropout", "linear2")

    @classmethod
    def supports(cls, linear1, act, dropout=None, linear2=None) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(linear1, act, dropout, linear2)`` would build, else ``(False, reason)``."""
        return parts.supports_of(cls._parse, linear1, act, dropout, linear2)

    @classmethod
    def _parse(cls, linear1, act, dropout, linear2):
        return parts.parse_chain(linear1, act, dropout, linear2, names=cls._NAMES, second=True)

    @classmethod
    def from_modules(cls, linear1: nn.Module, act: nn.Module, dropout: nn.Module | None, linear2: nn.Module, *,
                     seed: int | None = None, recompute: bool = False,
                     register_second: bool = True) -> FusedLinearActDropoutLinear:
        transposed, act_name, p, _ = cls._parse(linear1, act, dropout, linear2)
        module = cls._build(linear1.weight, linear1.bias, linear2, p, act_name, seed=_dropout_seed(dropout, seed),
                            recompute=recompute, register_second=register_second, transposed=transposed)
        return module.train(linear1.training)

    @classmethod
    def _build(cls, weight, bias, linear2, p, act, **kw):
        return cls(weight, bias, linear2, p, act, **kw)

    @property
    def _second(self) -> nn.Module:
        return self._modules["linear2"] if "linear2" in self._modules else self.__dict__["_linear2_ref"]

    @property
    def weight2(self) -> nn.Parameter:
        return self._second.weight

    @property
    def bias2(self) -> nn.Parameter | None:
        return self._second.bias

    @property
    def out_features(self) -> int:
        return parts.features(self.weight2, self.transposed2)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _amp.region(x) as cast:
            x, weight, bias, weight2, bias2 = cast(x, self.weight, self.bias, self.weight2, self.bias2)
            _check_input(x, weight, self.in_features)
            if not self.training and not torch.is_grad_enabled():  # nothing to save: plain ops
                h = self._first(x, weight, bias)
                y = parts.linear2d(h.reshape(-1, h.shape[-1]), weight2, bias2, self.transposed2)
                return y.view(*x.shape[:-1], self.out_features)
            return _unflatten(LinearActDropoutLinearFunction.apply(x, weight, bias, weight2, bias2, *self._draw(x),
                                                                   self.transposed2), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, hidden={self.hidden_features}, out_features={self.out_features}, "
                f"p={self.p}, act={self.act!r}, recompute={self.recompute}")


# --------------------------------------------------------------------------- the GELU names (DESIGN.md)
def _gelu_only(parsed, name):
    if parsed[1] not in _GELU_ACTS:
        raise TypeError(f"{name}: activation is {parsed[1]}; FusedLinearGELUDropout* fuse GELU only "
                        "(use FusedLinearActDropout*)")
    return parsed


class FusedLinearGELUDropout(FusedLinearActDropout):
    """``FusedLinearActDropout`` restricted to GELU (erf or tanh), with nn.GELU's ``approximate`` spelling."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, p: float = 0.0,
                 approximate: str = "none", *, seed: int | None = None, recompute: bool = False,
                 transposed: bool = False):
        check_choice("approximate", approximate, ("none", "tanh"))
        super().__init__(weight, bias, p, {v: k for k, v in _GELU_ACTS.items()}[approximate], seed=seed,
                         recompute=recompute, transposed=transposed)

    @classmethod
    def _parse(cls, linear, gelu, dropout):
        return _gelu_only(parts.parse_chain(linear, gelu, dropout, names=("linear", "gelu", "dropout")), "gelu")

    @classmethod
    def _build(cls, weight, bias, p, act, **kw):
        return cls(weight, bias, p, _GELU_ACTS[act], **kw)

    @property
    def approximate(self) -> str:
        return _GELU_ACTS[self.act]


class FusedLinearGELUDropoutLinear(FusedLinearActDropoutLinear):
    """``FusedLinearActDropoutLinear`` restricted to GELU (erf or tanh), with nn.GELU's ``approximate`` spelling."""

    _NAMES = ("linear1", "gelu", "dropout", "linear2")

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, linear2: nn.Module, p: float = 0.0,
                 approximate: str = "none", *, seed: int | None = None, recompute: bool = False,
                 register_second: bool = True, transposed: bool = False):
        check_choice("approximate", approximate, ("none", "tanh"))
        super().__init__(weight, bias, linear2, p, {v: k for k, v in _GELU_ACTS.items()}[approximate], seed=seed,
                         recompute=recompute, register_second=register_second, transposed=transposed)

    @classmethod
    def _parse(cls, linear1, gelu, dropout, linear2):
        return _gelu_only(parts.parse_chain(linear1, gelu, dropout, linear2, names=cls._NAMES, second=True), "gelu")

    @classmethod
    def _build(cls, weight, bias, linear2, p, act, **kw):
        return cls(weight, bias, linear2, p, _GELU_ACTS[act], **kw)

    @property
    def approximate(self) -> str:
        return _GELU_ACTS[self.act]
