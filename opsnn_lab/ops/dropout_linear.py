"""``linear(dropout(x))`` as one autograd op that saves ``x``, never the dropped copy or its mask.

Eager keeps two tensors per element of ``x`` for this pair: dropout's bool mask (1 byte) and the dropped copy the
Linear needs for its weight gradient (the dtype's size). The fused op saves ``x`` itself and regenerates the
mask from its counter (``CounterRNG``, see ``dropout.py``) in backward, then drops ``x`` again for the weight
gradient. Where ``x`` is saved anyway (a norm's output, the input of several Linears) that is nothing at all.

The case it is built for is LoRA fine-tuning: peft computes every adapted projection as
``base(x) + lora_B(lora_A(lora_dropout(x))) * scaling``, each adapter with a dropout of its own, so a Llama
layer with adapters on q, k, v, o, gate, up and down keeps seven dropped copies and seven masks of its hidden
states (``lora_dropout=0.05`` is the common setting) where the fused ops keep the inputs once. Any other
``Dropout -> Linear`` (a classifier head after its dropout) fuses the same way.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_linear_input, check_range, check_type, first_derivative_only
from opsnn_lab.kernels import rng
from opsnn_lab.ops import _amp
from opsnn_lab.ops.dropout import CounterRNG, Dropout, _check_numel, _scale, apply_mask

__all__ = ["FusedDropoutLinear", "DropoutLinearFunction"]


def _masked(keep, scale, t, *_rng):
    """``t * keep * scale`` as ``dropout_mul`` computes it (the same bits), with a mask made once."""
    out = torch.mul(t, keep)
    return out if scale == 1.0 else out.mul_(scale)


class DropoutLinearFunction(torch.autograd.Function):
    """``dropout(x) @ W.T + b`` with the counter mask ``(p, seed, offset)``; saves x and W only.
    ``apply(x, weight, bias, p, seed, offset)``."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight, bias, p, seed, offset):
        ctx.rng, ctx.has_bias = (p, seed, offset), bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(apply_mask(x, p, seed, offset), weight, bias)

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("FusedDropoutLinear")
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        g2 = grad.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        drop = apply_mask
        if need[0] and need[1] and not rng.fuses_dropout_mul(x):  # one mask for both (the torch path makes it)
            p, seed, offset = ctx.rng
            keep = rng.dropout_mask(seed, offset, x.shape, p, x.device, dtype=x.dtype)
            drop = functools.partial(_masked, keep, _scale(p))
        if need[0]:
            grad_x = drop((g2 @ weight).view(x.shape), *ctx.rng)
        if need[1]:
            grad_w = g2.t() @ drop(x, *ctx.rng).reshape(-1, weight.shape[1])
        if need[2] and ctx.has_bias:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


class FusedDropoutLinear(CounterRNG, nn.Module):
    """``linear(dropout(x))`` saving ``x`` only; the mask is counter-based (``rng_seed``, ``rng_step``, ``set_rng``).

    ``linear``: an ``nn.Linear`` (bias or not), kept as the model's own module (its Parameters, its state_dict
    keys). ``p``: the dropout probability (``from_modules`` reads it from an ``nn.Dropout`` or
    ``opsnn_lab.ops.Dropout``). Eval mode, or ``p = 0``: the Linear alone. Each training-mode call draws once,
    whether or not ``p > 0``, as every counter-RNG module does.
    """

    def __init__(self, linear: nn.Linear, p: float = 0.5, *, seed: int | None = None, register: bool = True):
        super().__init__()
        check_type("linear", linear, nn.Linear)
        self.p = float(check_range("p", p, 0.0, 1.0))
        if check_type("register", register, bool):
            self.linear = linear
        else:
            object.__setattr__(self, "_ref", linear)
        self._init_rng(seed)

    @classmethod
    def supports(cls, dropout, linear) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(dropout, linear)`` would build, else ``(False, reason)``."""
        if not isinstance(dropout, (nn.Dropout, Dropout)):
            return False, f"dropout must be nn.Dropout or opsnn_lab.ops.Dropout, got {type(dropout).__name__}"
        if type(linear) is not nn.Linear:  # a subclass may compute something else (probed ones are analysed)
            return False, f"linear must be nn.Linear, got {type(linear).__name__}"
        return True, ""

    @classmethod
    def from_modules(cls, dropout: nn.Module, linear: nn.Linear, *, seed: int | None = None,
                     register: bool = True) -> FusedDropoutLinear:
        ok, why = cls.supports(dropout, linear)
        if not ok:
            raise TypeError(why)
        if seed is None and isinstance(dropout, Dropout):
            seed = dropout.rng_seed
        return cls(linear, dropout.p, seed=seed, register=register).train(dropout.training)

    @property
    def layer(self) -> nn.Linear:
        return self.__dict__["_ref"] if "_ref" in self.__dict__ else self.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.layer
        if not self.training:  # the weights, not ``lin(x)``: a fusion rewrite has the module pass the op's output on
            return F.linear(x, lin.weight, lin.bias)
        with _amp.region(x) as cast:
            x, w, b = cast(x, lin.weight, lin.bias)
            check_linear_input(x, lin, weight=w)
            if self.p > 0.0:  # checked before the draw: nothing advances
                _check_numel(x)
            seed, offset = self.next_draw(x)
            if self.p == 0.0:
                return F.linear(x, w, b)
            return DropoutLinearFunction.apply(x, w, b, self.p, seed, offset)

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.rng_seed}, step={self.rng_step}"
