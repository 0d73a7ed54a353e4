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
from opsnn_lab.ops._activations import activation_of

__all__ = ["FusedGroupNormAct", "GroupNormActFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class GroupNormActFunction(torch.autograd.Function):
    """``apply(x, weight, bias, groups, eps, act)`` -> ``act(group_norm(x))``; saves x, mean and 1/std."""

    @staticmethod
    @_amp.no_autocast
    def forward(ctx, x, weight, bias, groups, eps, act):
        x = _dense(x)  # the kernels read x densely; eager's group_norm saves such a copy too
        out, mean, rstd = group_norm_act_forward(x, weight, bias, groups, eps, act)
        ctx.cfg = (groups, act)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    @_amp.no_autocast
    def backward(ctx, grad):
        first_derivative_only("FusedGroupNormAct")
        x, weight, bias, mean, rstd = ctx.saved_tensors
        groups, act = ctx.cfg
        need = ctx.needs_input_grad
        gx, gw, gb = group_norm_act_backward(grad, x, weight, bias, mean, rstd, groups, act, need[:3])
        return gx if need[0] else None, gw, gb, None, None, None


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous in its own memory format (channels-last kept: aten's kernels take it as it is)."""
    if x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        return x
    return x.contiguous()


def _why_not(norm, act) -> tuple[Act | None, str]:
    if not isinstance(norm, nn.GroupNorm):
        return None, f"norm must be nn.GroupNorm, got {type(norm).__name__}"
    spec, why = activation_of(act)
    return spec, why


class FusedGroupNormAct(nn.Module):
    """``act(group_norm(x))`` saving x and the statistics only (see the module docstring)."""

    def __init__(self, norm: nn.GroupNorm, act: Act, *, register: bool = True, name: str = "norm"):
        super().__init__()
        if not isinstance(norm, nn.GroupNorm):
            raise TypeError(f"norm must be nn.GroupNorm, got {type(norm).__name__}")
        self.act = check_type("act", act, Act)
        if check_type("register", register, bool):
            self.add_module(check_type("name", name, str), norm)
        else:
            object.__setattr__(self, "_norm", norm)
        self.name = name

    @property
    def norm(self) -> nn.GroupNorm:
        return self.__dict__["_norm"] if "_norm" in self.__dict__ else self._modules[self.name]

    @classmethod
    def supports(cls, norm, act) -> tuple[bool, str]:
        """``(True, "")`` if ``from_modules(norm, act)`` would build, else ``(False, reason)``."""
        spec, why = _why_not(norm, act)
        return spec is not None, why

    @classmethod
    def from_modules(cls, norm: nn.GroupNorm, act: nn.Module, *, register: bool = True,
                     name: str = "norm") -> FusedGroupNormAct:
        spec, why = _why_not(norm, act)
        if spec is None:
            raise (TypeError if "must be" in why else ValueError)(why)
        return cls(norm, spec, register=register, name=name).train(norm.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        check_tensor("x", x, dtypes=_FLOATS)
        if x.dim() < 2 or x.shape[1] != norm.num_channels:
            raise ValueError(f"x must be (N, {norm.num_channels}, *), got shape {tuple(x.shape)}")
        if x.device.type == "cuda" and _amp.autocast_dtype(x) is not None and x.dtype in (torch.float16,
                                                                                        torch.bfloat16):
            x = x.float()  # CUDA autocast runs group_norm in fp32 (CPU autocast in the input's dtype)
        return GroupNormActFunction.apply(x, norm.weight, norm.bias, norm.num_groups, norm.eps, self.act)

    def extra_repr(self) -> str:
        n = self.norm
        return f"groups={n.num_groups}, channels={n.num_channels}, eps={n.eps}, act={self.act.name!r}"
