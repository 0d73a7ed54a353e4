"""The gated product ``act(gate) * up`` alone, for gated MLPs whose projections are not plain Linear layers.

``FusedGatedMLP`` fuses ``down(act(gate(x)) * up(x))`` when gate, up and down are ``nn.Linear``: one GEMM for
``[gate | up]`` and nothing I-sized saved but the pre-activations. Many models people train compute the gate and
up projections some other way: a low-rank adapter around each Linear (LoRA fine-tuning: ``base(x) + B(A(x))``),
a quantised layer, one packed projection split by ``chunk``, or a hand-written expert. What stays fusable there is
the product itself. Per element of the product (I per token), eager saves for backward:

==============  ==========================================  ======
eager           the gate (act's input), act(gate) and up     3 I
fused           the gate and up; act(gate) recomputed         2 I
==============  ==========================================  ======

The backward recomputes ``act(gate)`` from the saved gate (one elementwise pass, ``kernels.gated_mlp``:
``gated_product_fwd`` / ``gated_product_bwd``: Triton on GPU, torch on CPU). With a ReLU there is nothing to
save: eager's ReLU keeps its output, which the product needs anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import check_choice, first_derivative_only
from opsnn_lab.kernels.gated_mlp import gated_product_bwd, gated_product_fwd
from opsnn_lab.ops import _mlp_parts as parts

__all__ = ["FusedGatedProduct", "GatedProductFunction"]


class GatedProductFunction(torch.autograd.Function):
    """``act(gate) * up``; saves gate and up only. ``apply(gate, up, act)``."""

    @staticmethod
    def forward(ctx, gate, up, act):
        out = gated_product_fwd(gate, up, act)  # checks first: a bad argument is named before anything is saved
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad):
        first_derivative_only("FusedGatedProduct")
        gate, up = ctx.saved_tensors
        dg, du = gated_product_bwd(grad.to(gate.dtype), gate, up, ctx.act)
        need = ctx.needs_input_grad
        return dg if need[0] else None, du if need[1] else None, None


class FusedGatedProduct(nn.Module):
    """``forward(gate, up) -> act(gate) * up`` saving gate and up, never ``act(gate)``.

    ``act``: ``gelu``, ``gelu_tanh``, ``quick_gelu``, ``silu`` or ``relu`` (``from_modules`` reads it from an
    activation module: ``nn.SiLU``, ``nn.GELU``, Hugging Face ``ACT2FN`` modules). ``gate`` and ``up``: float
    tensors of one shape, dtype and device (the product does not broadcast); any layout (views whose rows are
    strided, such as the two halves of one projection, are read in place)."""

    def __init__(self, act: str = "silu"):
        super().__init__()
        self.act = check_choice("act", act, parts.ACTS)

    @classmethod
    def supports(cls, act) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(act)`` would build, else ``(False, reason)``."""
        name, why = parts.activation_name(act)
        return (True, "") if name is not None else (False, why)

    @classmethod
    def from_modules(cls, act: nn.Module) -> FusedGatedProduct:
        name, why = parts.activation_name(act)
        if name is None:
            raise TypeError(f"act: {why}")
        return cls(name)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return GatedProductFunction.apply(gate, up, self.act)  # gated_product_fwd checks both, naming them

    def extra_repr(self) -> str:
        return f"act={self.act!r}"
