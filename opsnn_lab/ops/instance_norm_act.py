"""InstanceNorm -> activation as one autograd op: a GroupNorm with one group per channel
(``kernels.group_norm_act``, through :class:`GroupNormActFunction`).

Segmentation and image-to-image nets write ``Conv -> InstanceNorm -> LeakyReLU / ReLU`` in every block (nnU-Net's
``ConvDropoutNormReLU``, MONAI's ``Convolution`` with instance norm, CycleGAN's and pix2pix's ResNet generators).
Per element of the (N, C, *) input, what is saved for backward:

=======================================  =======================================  =======================
chain                                    eager saves                              fused saves
=======================================  =======================================  =======================
``InstanceNorm3d -> LeakyReLU``          x, the normalised y, 2 stats per plane   x, 2 stats per plane
=======================================  =======================================  =======================

Eager's ``instance_norm`` runs ``batch_norm`` on an ``(1, N * C, *)`` view; the statistics are the same per
(sample, channel) plane, formed by another kernel (bits differ at rounding level). Autocast leaves instance_norm
in its input's dtype on CPU and CUDA, and so does the op.

Running statistics (``track_running_stats=True``): in training the op normalises with the plane's own statistics,
as eager does, and updates ``running_mean`` / ``running_var`` as eager's ``instance_norm`` does (the batch's mean
of each plane's mean and unbiased variance, by ``momentum``; a ``momentum`` of None leaves them as they are, as
``nn.InstanceNorm*d`` passes 0 then; an empty batch leaves them, where eager's averages over no sample and writes NaN).
In eval mode with running statistics it runs eager's ``instance_norm`` and the activation: that normalisation is an
affine map per channel, and nothing of it is worth fusing.

Contract (``supports`` says yes or gives the reason; ``from_modules`` raises ``ValueError`` / ``TypeError`` with
it): ``norm`` an ``nn.InstanceNorm1d`` / ``2d`` / ``3d`` (affine or not), ``act`` a supported activation module
(``ops._activations``). Inputs batched ``(N, C, *)`` or unbatched ``(C, *)`` as the norm takes them; without
affine parameters any channel count runs (eager warns and runs too). The fused module references the norm's own
Parameters and buffers (``state_dict`` keys unchanged where it is registered under the norm's name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_tensor
from opsnn_lab.ops.group_norm_act import GroupNormActFunction, NormAct

__all__ = ["FusedInstanceNormAct"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_NOT_A_NORM = "norm must be nn.InstanceNorm1d, nn.InstanceNorm2d or nn.InstanceNorm3d, got {}"


def _spatial_dims(norm: nn.Module) -> int:
    return next(i + 1 for i, cls in enumerate(_NORMS) if isinstance(norm, cls))


@torch.no_grad()
def _update_running_stats(norm: nn.Module, x: torch.Tensor) -> None:
    """What eager's ``instance_norm`` does to the buffers: per plane, ``(1 - m) * running + m * stat``, averaged
    over the batch (the unbiased variance, as ``batch_norm`` keeps it)."""
    m = norm.momentum if norm.momentum is not None else 0.0
    planes = x.detach().flatten(2)
    var, mean = torch.var_mean(planes.to(norm.running_mean.dtype), dim=-1, correction=1 if planes.shape[-1] > 1 else 0)
    norm.running_mean.copy_(((1 - m) * norm.running_mean + m * mean).mean(0))
    norm.running_var.copy_(((1 - m) * norm.running_var + m * var).mean(0))


class FusedInstanceNormAct(NormAct):
    """``act(instance_norm(x))`` saving x and the statistics only (see the module docstring)."""


    @classmethod
    def _norm_reason(cls, norm) -> str:
        return "" if isinstance(norm, _NORMS) else _NOT_A_NORM.format(type(norm).__name__)

    @classmethod
    def _channels(cls, norm) -> int | None:
        return norm.num_features if norm.affine else None  # without affine any channel count runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        check_tensor("x", x, dtypes=_FLOATS)
        dims = _spatial_dims(norm)
        if x.dim() == dims + 1:  # unbatched (C, *), as the norm takes it
            return self(x.unsqueeze(0)).squeeze(0)
        if x.dim() != dims + 2 or (norm.affine and x.shape[1] != norm.num_features):
            channels = norm.num_features if norm.affine else "C"
            raise ValueError(f"x must be ({channels}, *) or (N, {channels}, *) with {dims} spatial dims for "
                             f"{type(norm).__name__}, got shape {tuple(x.shape)}")
        if norm.track_running_stats and not norm.training:  # an affine map per channel from the running stats
            y = F.instance_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps)
            # the PReLU's weight, not its module: in a fused model its forward passes the chain's output on
            return F.prelu(y, self._slope(y)) if self.prelu is not None else self.act.forward(y, inplace=False)
        if x.numel() and x[0, 0].numel() == 1:  # eager's check: one element normalises to 0
            raise ValueError(f"x must have more than 1 spatial element when training, got shape {tuple(x.shape)}")
        if norm.track_running_stats and x.numel():
            _update_running_stats(norm, x)
        return GroupNormActFunction.apply(x, norm.weight, norm.bias, x.shape[1], norm.eps, self.act, self._slope(x))

    def extra_repr(self) -> str:
        n = self.norm
        return (f"{type(n).__name__}, channels={n.num_features}, eps={n.eps}, affine={n.affine}, "
                f"track_running_stats={n.track_running_stats}, act={self._act_repr()}")
