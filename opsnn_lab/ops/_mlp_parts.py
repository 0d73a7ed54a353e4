"""Recognising the parts of MLP chains: activations (torch and Hugging Face ``ACT2FN``) and Linear layers.

Activations are named as in ``torch.nn.functional`` / ``ACT2FN``: ``gelu`` (erf), ``gelu_tanh``, ``quick_gelu``,
``silu``, ``relu``. A module is recognised by its class name (``nn.GELU``, ``nn.SiLU``, ``nn.ReLU`` and the Hugging
Face classes below; transformers is never imported) and must then compute that function on a float64 probe,
so a subclass that changes ``forward`` is refused. A parameter-free module with an unknown class name is
recognised by behaviour alone when it matches exactly one activation on the probe (e.g. a hand-written Swish).

Linear layers are ``nn.Linear`` (weight ``[out, in]``, ``y = x @ W.T + b``) and Hugging Face ``Conv1D`` (GPT-2;
weight ``[in, out]``, ``y = x @ W + b``), which is recognised by class name and its ``nx``/``nf`` attributes.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab.kernels.gelu_dropout import ACTS, act_forward
from opsnn_lab.ops.dropout import Dropout

__all__ = ["ACTS", "activation_name", "exact_in_float64", "linear_layout", "dropout_p", "features",
           "parse_act_dropout", "parse_chain", "supports_of", "in_out", "linear2d", "grad_weight"]

_HF_ACTS = {  # class name -> activation (transformers.activations, 4.x and 5.x)
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "ReLU": "relu",
}
_PROBE_TOL = 1e-7  # float64: gelu and gelu_tanh differ by up to 2e-4 on the probe, so this separates them


def _probe_outputs(module):
    # the curved part densely, and far-out points where clipped variants (HF gelu_10, relu6) differ
    far = torch.tensor([-100.0, -30.0, -12.0, 12.0, 30.0, 100.0], dtype=torch.float64)
    x = torch.cat([torch.linspace(-6.0, 6.0, 121, dtype=torch.float64), far])
    try:  # forward, not __call__: the user's hooks do not see the probe, nor does their RNG stream move
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            y = module.forward(x.clone())
    except Exception:  # a module that cannot run on a float64 vector is not a pointwise activation
        return None, x
    return (y if isinstance(y, torch.Tensor) and y.shape == x.shape else None), x


def _matches(module) -> list[str]:
    y, x = _probe_outputs(module)
    if y is None:
        return []
    return [a for a in ACTS if torch.allclose(y.double(), act_forward(x, a), atol=_PROBE_TOL, rtol=_PROBE_TOL)]


def exact_in_float64(module, name: str) -> bool:
    """Whether ``module`` computes ``name`` to float64 rounding on a float64 probe; False for one that computes in
    float32 inside and casts back (diffusers' ``FP32SiLU``: ``F.silu(x.float()).to(x.dtype)``), which the probe's
    tolerance takes for that activation: the same function in float32 and lower, not in a float64 model."""
    y, x = _probe_outputs(module)
    return y is not None and torch.allclose(y.double(), act_forward(x, name), atol=1e-12, rtol=1e-12)


def activation_name(module) -> tuple[str | None, str]:
    """``(name, "")`` for a supported activation module, else ``(None, reason)``."""
    if not isinstance(module, nn.Module):
        return None, f"the activation must be an nn.Module, got {type(module).__name__}"
    cls = type(module).__name__
    if any(True for _ in module.parameters()):
        return None, f"activation {cls} has parameters; only parameter-free pointwise activations fuse"
    if isinstance(module, nn.GELU):
        name = "gelu_tanh" if module.approximate == "tanh" else "gelu"
    else:
        name = _HF_ACTS.get(cls)
    found = _matches(module)
    if name is None:
        if len(found) == 1:
            return found[0], ""
        return None, f"activation {cls} is not one of {', '.join(ACTS)}"
    if name not in found:
        return None, f"activation {cls} does not compute {name} (checked on a probe)"
    return name, ""


def linear_layout(module) -> tuple[bool | None, str]:
    """``(transposed, "")`` for nn.Linear (False) or Hugging Face Conv1D (True), else ``(None, reason)``."""
    if isinstance(module, nn.Linear):
        return False, ""
    w = getattr(module, "weight", None)
    if (type(module).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))):
        return True, ""
    return None, f"{type(module).__name__} is neither nn.Linear nor Hugging Face Conv1D"


def features(weight: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """``(in_features, out_features)`` of a weight in either layout."""
    return (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])


def dropout_p(dropout) -> tuple[float | None, str]:
    if dropout is None:
        return 0.0, ""
    if isinstance(dropout, (nn.Dropout, Dropout)):
        return float(dropout.p), ""
    return None, f"dropout must be nn.Dropout or opsnn_lab.ops.Dropout, got {type(dropout).__name__}"


# ------------------------------------------------------------------ one parse for supports() and from_modules()
def parse_act_dropout(act, dropout, names=("act", "dropout")) -> tuple[str, float]:
    """``(act_name, p)`` of a chain's activation and dropout, or TypeError naming the argument."""
    act_name, why = activation_name(act)
    if act_name is None:
        raise TypeError(f"{names[0]}: {why}")
    p, why = dropout_p(dropout)
    if p is None:
        raise TypeError(f"{names[1]}: {why}")
    return act_name, p


def parse_chain(linear, act, dropout, linear2=None, *, names=("linear", "act", "dropout", "linear2"), second=False):
    """``(transposed, act_name, p, transposed2)`` or raises TypeError/ValueError naming the argument."""
    transposed, why = linear_layout(linear)
    if transposed is None:
        raise TypeError(f"{names[0]}: {why}")
    act_name, p = parse_act_dropout(act, dropout, names[1:3])
    if not second:
        return transposed, act_name, p, None
    transposed2, why = linear_layout(linear2)
    if transposed2 is None:
        raise TypeError(f"{names[3]}: {why}")
    out1 = features(linear.weight, transposed)[1]
    in2 = features(linear2.weight, transposed2)[0]
    if in2 != out1:
        raise ValueError(f"{names[3]} must have in_features={out1} ({names[0]}'s out_features), got {in2}")
    return transposed, act_name, p, transposed2


def supports_of(parse, *args) -> tuple[bool, str]:
    try:
        parse(*args)
    except (TypeError, ValueError) as exc:
        return False, str(exc)
    return True, ""


# --------------------------------------------------------------------------- GEMMs in either layout
def in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight as an ``[in, out]`` matrix (a view)."""
    return weight if transposed else weight.t()


def linear2d(x2, weight, bias, transposed):
    """``x2 @ W (+ b)`` for a 2-D input, one GEMM (addmm when there is a bias)."""
    w = in_out(weight, transposed)
    return torch.addmm(bias, x2, w) if bias is not None else x2 @ w


def grad_weight(grad, x2, transposed):
    """Gradient of the weight in its own layout from the output gradient and the 2-D input."""
    return x2.t() @ grad if transposed else grad.t() @ x2
