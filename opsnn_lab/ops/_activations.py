"""Which pointwise activation a module computes: torch.nn activations and Hugging Face ``ACT2FN`` objects."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.kernels.bn_act import ACTS, Act

__all__ = ["activation_of", "is_prelu", "prelu_weight", "SUPPORTED_ACTIVATIONS"]

_TORCH = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.LeakyReLU: "leaky_relu", nn.SiLU: "silu", nn.Hardswish: "hardswish",
          nn.Mish: "mish", nn.ELU: "elu"}
# Hugging Face classes by name (transformers is never imported here). The tanh-GELU variants differ from
# F.gelu(approximate="tanh") only in rounding; each is also probed below, so a class whose behaviour changes
# in some release is refused instead of silently computing another function.
_HF = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
       "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "AccurateGELUActivation": "gelu_tanh",
       "SiLUActivation": "silu"}
SUPPORTED_ACTIVATIONS = ("ReLU", "ReLU6", "LeakyReLU", "SiLU", "Hardswish", "GELU", "Mish", "ELU (alpha 1)", *_HF)
_PROBE_TOL = 1e-5  # fp32 abs error of the HF tanh-GELU formulas against F.gelu(approximate="tanh") is ~5e-7


def _reference(act: Act, x: torch.Tensor) -> torch.Tensor:
    return act.forward(x.clone(), inplace=True)


def _computed(module: nn.Module) -> str | None:
    """The one activation of ``ACTS`` a parameter-free module of another class computes on a probe (timm's own
    ``GELU`` class, a hand-written swish), or None. The probe reaches past 6, where ReLU and ReLU6 part;
    ``leaky_relu`` is taken at its default slope only."""
    if next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
        return None
    x = torch.linspace(-8.0, 8.0, 129)
    try:
        with torch.no_grad():
            got = module(x.clone())
    except Exception:  # noqa: BLE001 - a module that cannot run on a CPU fp32 vector is not a pointwise activation
        return None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape or not got.is_floating_point():
        return None
    found = [n for n in ACTS if (got.float() - _reference(Act(n), x)).abs().max().item() <= _PROBE_TOL]
    return found[0] if len(found) == 1 else None


def activation_of(module, name: str = "act", also: tuple[str, ...] = ()) -> tuple[Act | None, str]:
    """``(Act, '')`` for a supported activation module, else ``(None, reason)``; ``name`` is the argument's name,
    ``also`` what the calling op takes besides (listed in the reason: the norm and conv-bn ops' PReLU)."""
    if not isinstance(module, nn.Module):
        return None, f"{name} must be an nn.Module activation, got {type(module).__name__}"
    kind = type(module)
    if kind is nn.ELU and float(module.alpha) != 1.0:
        return None, f"{name} (ELU) has alpha={module.alpha}; the fused kernels compute ELU with alpha 1"
    if kind in _TORCH:
        slope = float(module.negative_slope) if kind is nn.LeakyReLU else 0.01
        return Act(_TORCH[kind], slope), ""
    if kind is nn.GELU:
        return Act("gelu_tanh" if module.approximate == "tanh" else "gelu"), ""
    act_name = _HF.get(kind.__name__) if kind.__module__.startswith("transformers") else _computed(module)
    if act_name is None:
        return None, (f"{name} must be one of {', '.join((*SUPPORTED_ACTIVATIONS, *also))} (torch.nn or Hugging Face "
                      f"ACT2FN), or a parameter-free module computing one of them, got {kind.__module__}."
                      f"{kind.__name__}")
    act = Act(act_name)
    probe = torch.linspace(-6.0, 6.0, 97)
    with torch.no_grad():
        try:
            got = module(probe)
        except Exception as exc:  # a module that cannot run on a CPU fp32 vector is not a pointwise activation
            return None, f"{name} ({kind.__name__}) failed on a probe tensor: {type(exc).__name__}: {exc}"
    err = (got.float() - _reference(act, probe)).abs().max().item()
    if err > _PROBE_TOL:
        return None, f"{name} ({kind.__name__}) does not compute {act_name} (max error {err:.1e} on a probe)"
    return act, ""


def is_prelu(module) -> bool:
    """An ``nn.PReLU`` computing PReLU with its weight: its own forward, or a subclass's (timm's ``PReLU``, which
    calls ``F.prelu`` itself) found to on a probe. The norm and conv-bn ops run it as a leaky ReLU whose slope is that
    weight, read at each call."""
    if not isinstance(module, nn.PReLU):
        return False
    if type(module).forward is nn.PReLU.forward:
        return True
    w = module.weight.detach()
    probe = torch.linspace(-6.0, 6.0, 97, dtype=w.dtype, device=w.device).view(1, 1, -1).expand(2, w.numel(), -1)
    with torch.no_grad():
        try:
            got = module(probe)
        except Exception:  # a subclass that cannot run on a probe is not a PReLU the ops can stand in for
            return False
    return got.shape == probe.shape and bool(torch.equal(got, F.prelu(probe, w)))


def prelu_weight(weight: torch.Tensor, x: torch.Tensor, autocast: torch.dtype | None,
                 name: str = "act") -> torch.Tensor:
    """A PReLU's weight as a fused op applies it to ``x``: cast to ``autocast`` (the dtype autocast was on for
    ``x``'s device, or None) where autocast would cast it (``prelu`` runs in autocast's dtype on CPU and CUDA; float64
    stays), else in ``x``'s dtype or a TypeError naming ``name``, as ``F.prelu`` takes one dtype."""
    if autocast is not None and x.dtype != torch.float64 and weight.dtype != torch.float64:
        return weight.to(autocast)
    if weight.dtype != x.dtype:
        raise TypeError(f"{name} (PReLU) weight is {weight.dtype} and the input {x.dtype}: F.prelu takes one dtype "
                        "outside autocast")
    return weight
