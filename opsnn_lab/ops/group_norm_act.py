"""GroupNorm -> activation as one autograd op (``kernels.group_norm_act``).

Per element of the (N, C, *) input, what is saved for backward:

=======================================  =======================================  =======================
chain                                    eager saves                              fused saves
=======================================  =======================================  =======================
``GroupNorm -> SiLU`` (a UNet's block)   x, the normalised y, 2 stats per group    x, 2 stats per group
=======================================  =======================================  =======================

So the chain keeps half its bytes; the conv after it saves the activation's output either way. The normalised
values are recomputed in backward from x and the statistics, as aten's kernel forms them, so the activation's
derivative is taken where eager's was. Under CUDA's ``torch.autocast`` a half-precision input is widened to fp32
first, as autocast runs ``group_norm`` there (on its fp32 list; CPU autocast leaves it in the input's dtype),
and autocast is off inside.

Contract for the fusion rewrite (``supports`` says yes or gives the reason; ``from_modules`` raises
``ValueError`` / ``TypeError`` with it): ``norm`` an ``nn.GroupNorm`` (affine or not), ``act`` a supported
activation module (``ops._activations``: ReLU, ReLU6, LeakyReLU, SiLU, Hardswish, GELU, Mish, ELU at alpha 1,
Hugging Face ACT2FN ones). The fused module references the GroupNorm's own Parameters (``state_dict`` keys
unchanged where it is registered under the norm's name).
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab._checks import check_tensor, check_type, first_derivative_only
from opsnn_lab.kernels.bn_act_spec import Act
from opsnn_lab.kernels.group_norm_act import group_norm_act_backward, group_norm_act_forward
from opsnn_lab.ops import _amp
from opsnn_lab.ops._activations import activation_of, is_prelu, prelu_weight

__all__ = ["FusedGroupNormAct", "GroupNormActFunction", "NormAct", "act_spec"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class GroupNormActFunction(torch.autograd.Function):
    """``apply(x, weight, bias, groups, eps, act, slope=None)`` -> ``act(group_norm(x))``; saves x, mean and 1/std.
    ``slope``: a PReLU's weight (1 or C values), the activation then being that PReLU."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight, bias, groups, eps, act, slope=None):
        x = _dense(x)  # the kernels read x densely; eager's group_norm saves such a copy too
        out, mean, rstd = group_norm_act_forward(x, weight, bias, groups, eps, act, slope)
        ctx.cfg = (groups, act)
        ctx.save_for_backward(x, weight, bias, mean, rstd, slope)
        return out

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("FusedGroupNormAct")
        x, weight, bias, mean, rstd, slope = ctx.saved_tensors
        groups, act = ctx.cfg
        need = ctx.needs_input_grad
        gx, gw, gb, gs = group_norm_act_backward(grad, x, weight, bias, mean, rstd, groups, act,
                                                 (*need[:3], len(need) > 6 and need[6]), slope)
        return gx if need[0] else None, gw, gb, None, None, None, gs


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous in its own memory format (channels-last kept: aten's kernels take it as it is)."""
    if x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        return x
    return x.contiguous()


def act_spec(act, channels: int | None) -> tuple[Act | None, nn.PReLU | None, str]:
    """``(Act, prelu, '')`` for an activation module the norm ops compute, else ``(None, None, reason)``: a
    ``nn.PReLU`` (1 slope, or one per channel: ``channels`` where the norm fixes them) runs as a leaky ReLU whose
    slope is its weight, read at each call; the others as ``ops._activations`` names them."""
    if is_prelu(act):
        n = act.num_parameters
        if channels is not None and n not in (1, channels):
            return None, None, f"act (PReLU) has {n} parameters for {channels} channels"
        return Act("leaky_relu"), act, ""
    spec, why = activation_of(act, also=("PReLU",))
    return spec, None, why


class NormAct(nn.Module):
    """What the norm -> activation ops share: the norm (and a PReLU) referenced, registered or not, ``supports`` /
    ``from_modules`` and the PReLU's slope as the Function takes it. Subclasses name their norm (``_norm_reason``,
    ``_channels``) and compute."""


    def __init__(self, norm: nn.Module, act: Act, *, prelu: nn.PReLU | None = None, register: bool = True,
                 name: str = "norm"):
        super().__init__()
        if why := self._norm_reason(norm):
            raise TypeError(why)
        self.act = check_type("act", act, Act)
        if prelu is not None and not isinstance(prelu, nn.PReLU):
            raise TypeError(f"prelu must be nn.PReLU or None, got {type(prelu).__name__}")
        if check_type("register", register, bool):
            self.add_module(check_type("name", name, str), norm)
            if prelu is not None:
                self._modules["prelu"] = prelu  # add_module would refuse the name of the `prelu` property
        else:
            object.__setattr__(self, "_norm", norm)
            object.__setattr__(self, "_prelu", prelu)
        self.name = name

    @classmethod
    def _norm_reason(cls, norm) -> str:
        raise NotImplementedError

    @classmethod
    def _channels(cls, norm) -> int | None:
        raise NotImplementedError

    @property
    def norm(self) -> nn.Module:
        return self.__dict__["_norm"] if "_norm" in self.__dict__ else self._modules[self.name]

    @property
    def prelu(self) -> nn.PReLU | None:
        return self.__dict__["_prelu"] if "_prelu" in self.__dict__ else self._modules.get("prelu")

    @classmethod
    def _spec(cls, norm, act) -> tuple[Act | None, nn.PReLU | None, str]:
        if why := cls._norm_reason(norm):
            return None, None, why
        return act_spec(act, cls._channels(norm))

    @classmethod
    def supports(cls, norm, act) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(norm, act)`` would build, else ``(False, reason)``."""
        spec, _, why = cls._spec(norm, act)
        return spec is not None, why

    @classmethod
    def from_modules(cls, norm: nn.Module, act: nn.Module, *, register: bool = True, name: str = "norm"):
        spec, prelu, why = cls._spec(norm, act)
        if spec is None:
            raise (TypeError if "must be" in why else ValueError)(why)
        return cls(norm, spec, prelu=prelu, register=register, name=name).train(norm.training)

    def _slope(self, x: torch.Tensor) -> torch.Tensor | None:
        """The PReLU's weight for input ``x`` (None without a PReLU): cast to autocast's dtype where autocast would
        cast it (``prelu`` runs in autocast's dtype on CPU and CUDA)."""
        prelu = self.prelu
        if prelu is None:
            return None
        w = prelu.weight
        if w.numel() > 1 and w.numel() != x.shape[1]:
            raise ValueError(f"act (PReLU) has {w.numel()} parameters, x has {x.shape[1]} channels")
        return prelu_weight(w, x, _amp.autocast_dtype(x))

    def _act_repr(self) -> str:
        return "'prelu'" if self.prelu is not None else repr(self.act.name)


class FusedGroupNormAct(NormAct):
    """``act(group_norm(x))`` saving x and the statistics only (see the module docstring)."""


    @classmethod
    def _norm_reason(cls, norm) -> str:
        return "" if isinstance(norm, nn.GroupNorm) else f"norm must be nn.GroupNorm, got {type(norm).__name__}"

    @classmethod
    def _channels(cls, norm) -> int:
        return norm.num_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        check_tensor("x", x, dtypes=_FLOATS)
        if x.dim() < 2 or x.shape[1] != norm.num_channels:
            raise ValueError(f"x must be (N, {norm.num_channels}, *), got shape {tuple(x.shape)}")
        if x.device.type == "cuda" and _amp.autocast_dtype(x) is not None and x.dtype in (torch.float16,
                                                                                        torch.bfloat16):
            x = x.float()  # CUDA autocast runs group_norm in fp32 (CPU autocast in the input's dtype)
        return GroupNormActFunction.apply(x, norm.weight, norm.bias, norm.num_groups, norm.eps, self.act,
                                          self._slope(x))

    def extra_repr(self) -> str:
        n = self.norm
        return f"groups={n.num_groups}, channels={n.num_channels}, eps={n.eps}, act={self._act_repr()}"
