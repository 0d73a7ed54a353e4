"""Linear -> GELU -> Dropout, and the MLP chain Linear -> GELU -> Dropout -> Linear, as single autograd ops.

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
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_choice, check_range, check_tensor, check_type, same_device
from opsnn_lab.kernels import backend_for
from opsnn_lab.kernels.gelu_dropout import gelu_dropout_bwd, gelu_dropout_fwd
from opsnn_lab.ops.dropout import CounterRNG, Dropout

__all__ = [
    "FusedLinearGELUDropout",
    "FusedLinearGELUDropoutLinear",
    "LinearGELUDropoutFunction",
    "LinearGELUDropoutLinearFunction",
]

_MAX_NUMEL = 1 << 32


def _preactivation(x2, weight, bias, backend):
    """``x2 @ weight.T + bias`` as (h, bias still to add): the Triton kernel adds the bias itself."""
    if backend == "torch":
        h = torch.addmm(bias, x2, weight.t()) if bias is not None else x2 @ weight.t()
        return h, None
    return x2 @ weight.t(), bias


def _recompute_h(x2, weight, bias, backend):
    h, late_bias = _preactivation(x2, weight, bias, backend)
    return h if late_bias is None else h.add_(late_bias)


def _forward_h(ctx, x, weight, bias, cfg):
    """Shared forward half: returns ``(out2d, h, x2)`` and stores the config on ctx."""
    p, seed, offset, approximate, recompute = cfg
    x2 = x.reshape(-1, x.shape[-1])
    backend = backend_for(x2)
    h, late_bias = _preactivation(x2, weight, bias, backend)
    out, h = gelu_dropout_fwd(h, p, seed, offset, approximate, bias=late_bias)
    ctx.cfg, ctx.backend, ctx.lead = cfg, backend, x.shape[:-1]
    return out, h, x2


def _saved_h(ctx, x2, h, weight, bias):
    return _recompute_h(x2, weight, bias, ctx.backend) if h is None else h


class LinearGELUDropoutFunction(torch.autograd.Function):
    """``dropout(gelu(x @ W.T + b))``; saves x and h (or x only with ``recompute``), never the mask."""

    @staticmethod
    def forward(ctx, x, weight, bias, p, seed, offset, approximate, recompute):
        out, h, x2 = _forward_h(ctx, x, weight, bias, (p, seed, offset, approximate, recompute))
        ctx.save_for_backward(x2, weight, bias, None if recompute else h)
        return out.view(*ctx.lead, out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, weight, bias, h = ctx.saved_tensors
        p, seed, offset, approximate, _ = ctx.cfg
        h = _saved_h(ctx, x2, h, weight, bias)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h, grad_b, _ = gelu_dropout_bwd(grad.reshape(h.shape).to(h.dtype), h, p, seed, offset, approximate,
                                             want_bias=bias is not None and need_b)
        grad_x = (grad_h @ weight).view(*ctx.lead, weight.shape[1]) if need_x else None
        grad_w = grad_h.t() @ x2 if need_w else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


class LinearGELUDropoutLinearFunction(torch.autograd.Function):
    """``dropout(gelu(x @ W1.T + b1)) @ W2.T + b2``; the dropout output is recomputed for W2's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight2, bias2, p, seed, offset, approximate, recompute):
        d, h, x2 = _forward_h(ctx, x, weight, bias, (p, seed, offset, approximate, recompute))
        y = torch.addmm(bias2, d, weight2.t()) if bias2 is not None else d @ weight2.t()
        ctx.save_for_backward(x2, weight, bias, weight2, bias2, None if recompute else h)
        return y.view(*ctx.lead, y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, weight, bias, weight2, bias2, h = ctx.saved_tensors
        p, seed, offset, approximate, _ = ctx.cfg
        need_x, need_w, need_b, need_w2, need_b2 = ctx.needs_input_grad[:5]
        gy = grad.reshape(-1, weight2.shape[0]).to(weight2.dtype)
        h = _saved_h(ctx, x2, h, weight, bias)
        grad_x = grad_w = grad_b = grad_w2 = None
        if need_x or need_w or need_b:
            grad_h, grad_b, d = gelu_dropout_bwd(gy @ weight2, h, p, seed, offset, approximate,
                                                 want_bias=bias is not None and need_b, want_out=need_w2)
            grad_x = (grad_h @ weight).view(*ctx.lead, weight.shape[1]) if need_x else None
            grad_w = grad_h.t() @ x2 if need_w else None
        elif need_w2:
            d, _ = gelu_dropout_fwd(h, p, seed, offset, approximate)
        if need_w2:
            grad_w2 = gy.t() @ d
        grad_b2 = gy.sum(0) if bias2 is not None and need_b2 else None
        return grad_x, grad_w, grad_b, grad_w2, grad_b2, None, None, None, None, None


# --------------------------------------------------------------------------- modules
def _gelu_approximate(gelu) -> str:
    check_type("gelu", gelu, nn.GELU)
    return gelu.approximate


def _dropout_p(dropout) -> float:
    if dropout is None:
        return 0.0
    check_type("dropout", dropout, (nn.Dropout, Dropout), allow_none=True)
    return float(dropout.p)


def _dropout_seed(dropout, seed):
    # Carry the stream of an already counter-based Dropout unless a seed is given explicitly.
    return dropout.rng_seed if seed is None and isinstance(dropout, Dropout) else seed


def _check_input(x, weight, name="x"):
    check_tensor(name, x, min_dim=1)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name} must have {weight.shape[1]} features in its last dim, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the weight is {weight.dtype}; cast one of them")
    same_device(weight=weight, **{name: x})
    if x.numel() // max(x.shape[-1], 1) * weight.shape[0] > _MAX_NUMEL:
        raise ValueError(f"{name} gives more than 2**32 activations; split the batch")


class _FusedGELUDropoutBase(CounterRNG, nn.Module):
    def _setup(self, weight, bias, p, approximate, seed, recompute):
        check_type("weight", weight, nn.Parameter)
        check_type("bias", bias, nn.Parameter, allow_none=True)
        self.weight = weight
        self.register_parameter("bias", bias)
        self.p = float(check_range("p", p, 0.0, 1.0))
        self.approximate = check_choice("approximate", approximate, ("none", "tanh"))
        self.recompute = bool(check_type("recompute", recompute, bool))
        self._init_rng(seed)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def _draw(self):
        seed, offset = self.next_draw()
        return self.p, seed, offset, self.approximate, self.recompute


class FusedLinearGELUDropout(_FusedGELUDropoutBase):
    """``Dropout(GELU(Linear(x)))`` in one autograd op.

    Parameters: registers the Linear's own ``weight`` and ``bias`` Parameter objects (``from_modules``
    shares them, no copy), so a fusion rewrite that puts this module at the Linear's path keeps the
    state_dict keys ``<path>.weight`` / ``<path>.bias`` and their values.
    Dropout: counter-based, contract of ``opsnn_lab.ops.dropout`` (``rng_seed``, ``rng_step``,
    ``set_rng``). ``recompute=True`` saves only ``x`` and recomputes the pre-activation in backward.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, p: float = 0.0,
                 approximate: str = "none", *, seed: int | None = None, recompute: bool = False):
        super().__init__()
        self._setup(weight, bias, p, approximate, seed, recompute)

    @classmethod
    def from_modules(cls, linear: nn.Linear, gelu: nn.GELU, dropout: nn.Module | None = None, *,
                     seed: int | None = None, recompute: bool = False) -> FusedLinearGELUDropout:
        check_type("linear", linear, nn.Linear)
        module = cls(linear.weight, linear.bias, _dropout_p(dropout), _gelu_approximate(gelu),
                     seed=_dropout_seed(dropout, seed), recompute=recompute)
        return module.train(linear.training)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.weight)
        if not self.training:
            return F.gelu(F.linear(x, self.weight, self.bias), approximate=self.approximate)
        return LinearGELUDropoutFunction.apply(x, self.weight, self.bias, *self._draw())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"p={self.p}, approximate={self.approximate!r}, recompute={self.recompute}")


class FusedLinearGELUDropoutLinear(_FusedGELUDropoutBase):
    """``Linear2(Dropout(GELU(Linear1(x))))`` in one autograd op (the transformer MLP).

    Parameter contract (what a fusion rewrite relies on):

    * ``weight`` / ``bias`` are Linear1's own Parameter objects, registered on this module, so at Linear1's
      path the keys ``<path>.weight`` / ``<path>.bias`` are unchanged.
    * Linear2 is used by reference. With ``register_second=True`` (default) it is also a registered
      submodule ``linear2`` (keys ``linear2.weight`` / ``linear2.bias``; ``parameters()`` is complete for
      standalone use). With ``register_second=False`` it is NOT registered: the rewrite leaves the original
      Linear2 module at its own path, so its keys stay there and appear once. ``weight2`` / ``bias2`` always
      read Linear2's current Parameters.
    * Dropout: counter-based, contract of ``opsnn_lab.ops.dropout`` (``rng_seed``, ``rng_step``, ``set_rng``).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, linear2: nn.Linear, p: float = 0.0,
                 approximate: str = "none", *, seed: int | None = None, recompute: bool = False,
                 register_second: bool = True):
        super().__init__()
        self._setup(weight, bias, p, approximate, seed, recompute)
        check_type("linear2", linear2, nn.Linear)
        if linear2.in_features != weight.shape[0]:
            raise ValueError(f"linear2 must have in_features={weight.shape[0]} (linear1's out_features), "
                             f"got {linear2.in_features}")
        if linear2.weight.dtype != weight.dtype or linear2.weight.device != weight.device:
            raise TypeError("linear2 must have linear1's dtype and device, got "
                            f"{linear2.weight.dtype}/{linear2.weight.device} vs {weight.dtype}/{weight.device}")
        if check_type("register_second", register_second, bool):
            self.linear2 = linear2
        else:
            object.__setattr__(self, "_linear2_ref", linear2)

    @classmethod
    def from_modules(cls, linear1: nn.Linear, gelu: nn.GELU, dropout: nn.Module | None, linear2: nn.Linear, *,
                     seed: int | None = None, recompute: bool = False,
                     register_second: bool = True) -> FusedLinearGELUDropoutLinear:
        check_type("linear1", linear1, nn.Linear)
        module = cls(linear1.weight, linear1.bias, linear2, _dropout_p(dropout), _gelu_approximate(gelu),
                     seed=_dropout_seed(dropout, seed), recompute=recompute, register_second=register_second)
        return module.train(linear1.training)

    @property
    def _second(self) -> nn.Linear:
        return self._modules["linear2"] if "linear2" in self._modules else self.__dict__["_linear2_ref"]

    @property
    def weight2(self) -> nn.Parameter:
        return self._second.weight

    @property
    def bias2(self) -> nn.Parameter | None:
        return self._second.bias

    @property
    def out_features(self) -> int:
        return self.weight2.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.weight)
        if not self.training:
            h = F.gelu(F.linear(x, self.weight, self.bias), approximate=self.approximate)
            return F.linear(h, self.weight2, self.bias2)
        return LinearGELUDropoutLinearFunction.apply(x, self.weight, self.bias, self.weight2, self.bias2,
                                                     *self._draw())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, hidden={self.weight.shape[0]}, out_features={self.out_features}, "
                f"p={self.p}, approximate={self.approximate!r}, recompute={self.recompute}")
