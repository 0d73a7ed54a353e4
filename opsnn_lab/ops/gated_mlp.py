"""Gated MLP ``down(dropout(act(gate(x)) * up(x)))`` (SwiGLU, GeGLU) as one autograd op with gate and up in ONE GEMM.

Covers Llama / Mistral / Qwen ``gate_proj`` / ``up_proj`` / ``down_proj`` (SiLU) and T5's gated-gelu
``wi_0`` / ``wi_1`` / ``wo`` (tanh GELU, dropout before ``wo``), Gemma (tanh GELU); and, through
``FusedGatedMLP.from_packed``, one Linear whose output is split by ``chunk(2, -1)``: Phi-3's ``gate_up_proj``
(the gate first) and diffusers' ``GEGLU`` / ``SwiGLU`` (``hidden, gate = proj(x).chunk(2, -1)``: the gate second,
``gate_first=False``).

What is saved for backward, per token, hidden H, intermediate I (the elementwise kernels: ``kernels.gated_mlp``):

=======================  ===================================================  ==========================
eager                    x, gate pre-act, act(gate), up, product (+ mask)     H + 4I (+ I with dropout)
torch.compile (CPU)      x, gate, up and one more I-sized tensor              H + 3I
fused (default)          x, packed [gate | up]; product recomputed            H + 2I  (0.54 at H=1024, I=2816)
fused, recompute=True    x only; [gate | up] recomputed by one more GEMM      H
=======================  ===================================================  ==========================

Weights: ``pack=True`` moves gate's and up's weights (and biases, when both have one) into one buffer and
re-points the original Parameters' ``.data`` at its halves, as ``FusedQKV`` does: the Parameter objects,
their values and any optimizer holding them are unchanged and the GEMM reads the buffer without a copy.
If something re-points them later, that call concatenates (correct, one copy).
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import (
    check_choice,
    check_like,
    check_linear_input,
    check_range,
    check_type,
    first_derivative_only,
)
from opsnn_lab.kernels.gated_mlp import gated_act_bwd, gated_act_fwd
from opsnn_lab.ops import _amp
from opsnn_lab.ops import _mlp_parts as parts
from opsnn_lab.ops.dropout import CounterRNG, Dropout
from opsnn_lab.ops.qkv import _adjacent, _joined, _joined_bias, pack

__all__ = ["FusedGatedMLP", "FusedPackedGatedMLP", "GatedMLPFunction"]

_MAX_NUMEL = 1 << 32


def _gate_up(w_gate, w_up):
    """``[W_gate | W_up]``; ``w_up`` None: ``w_gate`` is that packed (2I, H) weight already (one Linear)."""
    return w_gate if w_up is None else _joined([w_gate, w_up])


def _packed_gemm(x2, w_gate, w_up, b_gate, b_up):
    """``x2 @ [W_gate | W_up].T (+ [b_gate | b_up])``: (M, 2I)."""
    if w_up is None:
        b = b_gate
    else:
        b = _joined_bias([b_gate, b_up], [w_gate.shape[0], w_up.shape[0]], w_gate)
    w = _gate_up(w_gate, w_up)
    return torch.addmm(b, x2, w.t()) if b is not None else x2 @ w.t()


class GatedMLPFunction(torch.autograd.Function):
    """``dropout(act(x @ Wg.T + bg) * (x @ Wu.T + bu)) @ Wd.T + bd``; saves x and the packed [gate | up] only.

    ``apply(x, w_gate, w_up, w_down, b_gate, b_up, b_down, act, p, seed, offset, recompute, gate_first)``;
    ``w_up`` and ``b_up`` None: ``w_gate`` / ``b_gate`` are one Linear's packed ``[gate | up]`` weight and bias
    (``[up | gate]`` where ``gate_first`` is False), and their gradients come back packed the same way.
    """

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, act, p, seed, offset, recompute, gate_first):
        x2 = x.reshape(-1, x.shape[-1])
        gu = _packed_gemm(x2, w_gate, w_up, b_gate, b_up)
        y = parts.linear2d(gated_act_fwd(gu, act, p, seed, offset, gate_first), w_down, b_down, False)
        ctx.cfg, ctx.lead = (act, p, seed, offset, gate_first), x.shape[:-1]
        ctx.has_bias = (b_gate is not None, b_up is not None)
        ctx.save_for_backward(x2, w_gate, w_up, w_down, b_gate, b_up, None if recompute else gu)
        return y  # (M, out): viewed outside the Function, so the caller may modify it in place

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("FusedGatedMLP")
        x2, w_gate, w_up, w_down, b_gate, b_up, gu = ctx.saved_tensors
        act, p, seed, offset, gate_first = ctx.cfg
        need = ctx.needs_input_grad
        gy = grad.reshape(-1, w_down.shape[0]).to(w_down.dtype)
        if gu is None:
            gu = _packed_gemm(x2, w_gate, w_up, b_gate, b_up)
        grad_gu, out = gated_act_bwd(gy @ w_down, gu, act, p, seed, offset, want_out=need[3], gate_first=gate_first)
        packed = w_up is None
        halves = (lambda t: (t, None)) if packed else (lambda t: t.split_with_sizes([w_gate.shape[0]] * 2))
        grad_x = (grad_gu @ _gate_up(w_gate, w_up)).view(*ctx.lead, x2.shape[1]) if need[0] else None
        grad_wg = grad_wu = grad_bg = grad_bu = None
        if need[1] or need[2]:
            grad_wg, grad_wu = halves(grad_gu.t() @ x2)  # one GEMM, halves of one buffer
        if (need[4] and ctx.has_bias[0]) or (need[5] and ctx.has_bias[1]):
            grad_bg, grad_bu = halves(grad_gu.sum(0))
        grad_wd = gy.t() @ out if need[3] else None
        grad_bd = gy.sum(0) if need[6] else None
        return (grad_x, grad_wg if need[1] else None, grad_wu if need[2] else None, grad_wd,
                grad_bg if need[4] and ctx.has_bias[0] else None, grad_bu if need[5] and ctx.has_bias[1] else None,
                grad_bd, None, None, None, None, None, None)


# --------------------------------------------------------------------------- recognising modules
def _parse_parts(linears: dict, act, dropout) -> tuple[str, float]:
    """The Linear types, the activation and the dropout of a gated MLP: ``(act_name, p)`` or TypeError."""
    for name, lin in linears.items():
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name} must be nn.Linear, got {type(lin).__name__}")
    act_name, why = parts.activation_name(act)
    if act_name is None:
        raise TypeError(f"act: {why}")
    p, why = parts.dropout_p(dropout)
    if p is None:
        raise TypeError(why)
    return act_name, p


def _parse(gate, up, down, act, dropout) -> tuple[str, float]:
    """``(act_name, p)`` or raises TypeError/ValueError naming the argument."""
    act_name, p = _parse_parts({"gate": gate, "up": up, "down": down}, act, dropout)
    if up.in_features != gate.in_features or up.out_features != gate.out_features:
        raise ValueError(f"up must have gate's shape ({gate.in_features} -> {gate.out_features}), "
                         f"got {up.in_features} -> {up.out_features}")
    if down.in_features != gate.out_features:
        raise ValueError(f"down must have in_features={gate.out_features} (gate's out_features), "
                         f"got {down.in_features}")
    for name, lin in (("up", up), ("down", down)):
        check_like(name, lin, "gate", gate)
    return act_name, p


def _check_input(x, first: nn.Linear, inter: int, weight) -> None:
    check_linear_input(x, first, weight=weight)
    if x.numel() // max(x.shape[-1], 1) * inter > _MAX_NUMEL:
        raise ValueError("x gives more than 2**32 activations; split the batch")


def _parse_packed(gate_up, down, act, dropout) -> tuple[str, float]:
    """``(act_name, p)`` for one Linear computing ``[gate | up]``, or raises TypeError/ValueError."""
    act_name, p = _parse_parts({"gate_up": gate_up, "down": down}, act, dropout)
    if gate_up.out_features % 2 or down.in_features * 2 != gate_up.out_features:
        raise ValueError(f"gate_up must have twice down's in_features ({down.in_features}) as out_features, "
                         f"got {gate_up.out_features}")
    check_like("down", down, "gate_up", gate_up)
    return act_name, p


def _check_names(names):
    check_type("names", names, tuple)
    if len(names) != 3 or len(set(names)) != 3 or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ValueError(f"names must be three distinct identifiers (gate, up, down), got {names!r}")
    return names


class FusedGatedMLP(CounterRNG, nn.Module):
    """``down(dropout(act(gate(x)) * up(x)))`` with gate and up as one GEMM; nothing activation-sized but x and
    the packed ``[gate | up]`` pre-activations is saved (x alone with ``recompute=True``).

    Contract (``supports`` says why a set of modules does not meet it; ``from_modules`` raises TypeError /
    ValueError naming the argument for the same reasons):

    * ``gate``, ``up``, ``down``: ``nn.Linear`` (bias or not, independently); gate and up of one shape,
      ``down.in_features == gate.out_features``; one dtype and device.
    * ``act``: a parameter-free activation module computing gelu, gelu_tanh, quick_gelu, silu or relu
      (``nn.SiLU``, ``nn.GELU``, Hugging Face ``ACT2FN`` modules; see ``_mlp_parts``). SwiGLU is silu,
      GeGLU gelu / gelu_tanh (T5 v1.1 and Gemma use the tanh form).
    * ``dropout``: None, ``nn.Dropout`` or ``opsnn_lab.ops.Dropout``, applied to the product before ``down``
      (T5); counter-based (``rng_seed``, ``rng_step``, ``set_rng``), the mask is never saved.
    * Parameters stay the three modules' own Parameter objects (``pack`` re-points gate's and up's ``.data``
      into one buffer, see the module docstring). ``register=True`` registers the modules under ``names``
      (default Llama's ``gate_proj``, ``up_proj``, ``down_proj``; T5: ``("wi_0", "wi_1", "wo")``), so a
      rewrite that puts this module at the MLP's path keeps the state_dict keys; ``register=False`` only
      references them, for a rewrite that leaves them at their own paths.
    """

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act: str = "silu", p: float = 0.0, *,
                 seed: int | None = None, recompute: bool = False, pack: bool = True, register: bool = True,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        _parse(gate, up, down, nn.SiLU(), None)  # the layers' checks; the activation is given by name here
        self.act = check_choice("act", act, parts.ACTS)
        self.p = float(check_range("p", p, 0.0, 1.0))
        self.recompute = bool(check_type("recompute", recompute, bool))
        self.names = _check_names(names)
        if check_type("register", register, bool):
            for name, lin in zip(names, (gate, up, down)):
                self.add_module(name, lin)
        else:
            object.__setattr__(self, "_refs", (gate, up, down))
        self._init_rng(seed)
        if check_type("pack", pack, bool):
            self.repack()

    @classmethod
    def supports(cls, gate, up, down, act, dropout=None) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(gate, up, down, act, dropout)`` would build, else ``(False, reason)``."""
        try:
            _parse(gate, up, down, act, dropout)
        except (TypeError, ValueError) as exc:
            return False, str(exc)
        return True, ""

    @classmethod
    def from_modules(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act: nn.Module,
                     dropout: nn.Module | None = None, *, seed: int | None = None, recompute: bool = False,
                     pack: bool = True, register: bool = True,
                     names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> FusedGatedMLP:
        act_name, p = _parse(gate, up, down, act, dropout)
        if seed is None and isinstance(dropout, Dropout):
            seed = dropout.rng_seed
        module = cls(gate, up, down, act_name, p, seed=seed, recompute=recompute, pack=pack, register=register,
                     names=names)
        return module.train(gate.training)

    @classmethod
    def from_packed(cls, gate_up: nn.Linear, down: nn.Linear, act: nn.Module, dropout: nn.Module | None = None,
                    *, seed: int | None = None, recompute: bool = False, register: bool = True,
                    names: tuple[str, str] = ("gate_up_proj", "down_proj"),
                    gate_first: bool = True) -> FusedPackedGatedMLP:
        """The gated MLP of a model that packs gate and up into one Linear, ``gate, up = gate_up(x).chunk(2, -1)``
        (Phi-3's ``gate_up_proj``), or ``up, gate = ...`` with ``gate_first=False`` (diffusers' ``GEGLU``): the
        fused op reads that weight as it is."""
        act_name, p = _parse_packed(gate_up, down, act, dropout)
        if seed is None and isinstance(dropout, Dropout):
            seed = dropout.rng_seed
        module = FusedPackedGatedMLP(gate_up, down, act_name, p, seed=seed, recompute=recompute, register=register,
                                     names=names, gate_first=gate_first)
        return module.train(gate_up.training)

    @classmethod
    def supports_packed(cls, gate_up, down, act, dropout=None) -> tuple[bool, str]:
        """``(True, "")`` if ``from_packed(gate_up, down, act, dropout)`` would build, else ``(False, reason)``."""
        try:
            _parse_packed(gate_up, down, act, dropout)
        except (TypeError, ValueError) as exc:
            return False, str(exc)
        return True, ""

    @property
    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """``(gate, up, down)``."""
        if "_refs" in self.__dict__:
            return self.__dict__["_refs"]
        return tuple(self._modules[n] for n in self.names)

    @property
    def packed(self) -> bool:
        """Whether the next forward reads gate's and up's weights without a copy."""
        gate, up, _ = self.linears
        return _adjacent([gate.weight, up.weight])

    def repack(self) -> None:
        """Move gate's and up's weights (and biases, if both have one) into one buffer; Parameters keep identity."""
        gate, up, _ = self.linears
        for attr in ("weight", "bias"):
            pack([getattr(gate, attr), getattr(up, attr)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.linears
        with _amp.region(x) as cast:  # under autocast: its matmul casts, autocast off inside
            x, *w = cast(x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias)
            _check_input(x, gate, gate.out_features, w[0])
            p, seed, offset = self._draw(x)
            y = GatedMLPFunction.apply(x, *w, self.act, p, seed, offset, self.recompute, True)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _draw(self, x) -> tuple[float, int, int]:
        if not self.training:  # eval neither draws nor advances the stream
            return 0.0, 0, 0
        seed, offset = self.next_draw(x)
        return self.p, seed, offset

    def extra_repr(self) -> str:
        gate, _, down = self.linears
        return (f"in_features={gate.in_features}, hidden={gate.out_features}, out_features={down.out_features}, "
                f"act={self.act!r}, p={self.p}, recompute={self.recompute}")


class FusedPackedGatedMLP(FusedGatedMLP):
    """:class:`FusedGatedMLP` where one Linear computes ``[gate | up]`` (``FusedGatedMLP.from_packed``).

    Saves what the two-Linear form saves (x and the packed pre-activations). The weight needs no packing: the
    GEMM reads ``gate_up.weight`` and its gradient comes back in that layout. ``register=True`` registers the
    two Linears under ``names`` (default ``("gate_up_proj", "down_proj")``). ``gate_first=False``: the Linear
    computes ``[up | gate]`` (diffusers' ``GEGLU``: ``hidden_states, gate = proj(x).chunk(2, -1)``).
    """

    gate_first = True  # the default of a module pickled before the field existed

    def __init__(self, gate_up: nn.Linear, down: nn.Linear, act: str = "silu", p: float = 0.0, *,
                 seed: int | None = None, recompute: bool = False, register: bool = True,
                 names: tuple[str, str] = ("gate_up_proj", "down_proj"), gate_first: bool = True):
        nn.Module.__init__(self)
        _parse_packed(gate_up, down, nn.SiLU(), None)
        self.act = check_choice("act", act, parts.ACTS)
        self.gate_first = bool(check_type("gate_first", gate_first, bool))
        self.p = float(check_range("p", p, 0.0, 1.0))
        self.recompute = bool(check_type("recompute", recompute, bool))
        check_type("names", names, tuple)
        if len(names) != 2 or len(set(names)) != 2 or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise ValueError(f"names must be two distinct identifiers (gate_up, down), got {names!r}")
        self.names = names
        if check_type("register", register, bool):
            for name, lin in zip(names, (gate_up, down)):
                self.add_module(name, lin)
        else:
            object.__setattr__(self, "_refs", (gate_up, down))
        self._init_rng(seed)

    @property
    def linears(self) -> tuple[nn.Linear, nn.Linear]:
        """``(gate_up, down)``."""
        if "_refs" in self.__dict__:
            return self.__dict__["_refs"]
        return tuple(self._modules[n] for n in self.names)

    @property
    def packed(self) -> bool:
        return True

    def repack(self) -> None:
        """Nothing to do: gate and up are one weight already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.linears
        with _amp.region(x) as cast:
            x, w_gu, w_down, b_gu, b_down = cast(x, gate_up.weight, down.weight, gate_up.bias, down.bias)
            _check_input(x, gate_up, gate_up.out_features // 2, w_gu)
            p, seed, offset = self._draw(x)
            y = GatedMLPFunction.apply(x, w_gu, None, w_down, b_gu, None, b_down, self.act, p, seed, offset,
                                       self.recompute, self.gate_first)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        gate_up, down = self.linears
        return (f"in_features={gate_up.in_features}, hidden={down.in_features}, out_features={down.out_features}, "
                f"act={self.act!r}, p={self.p}, recompute={self.recompute}, "
                f"packed={'[gate | up]' if self.gate_first else '[up | gate]'}")
