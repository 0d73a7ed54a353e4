"""Naming the model's own classes by what they compute: each is called once on a small probe before a trace
(a tracer must not see the probe), and one that computes a known op runs as that op (``graph.Probed``).

* an ``nn.Linear`` subclass with its own forward that equals ``F.linear`` (Falcon's ``FalconLinear``);
* a parameter-free module of unknown class that computes exactly one activation the fused ops take (Bloom's
  ``BloomGelu``, a hand-written ``NewGELU`` or Swish; see ``opsnn_lab.ops._mlp_parts``);
* a ``BatchNorm2d`` subclass with its own forward whose children are one activation and ``nn.Identity``
  placeholders (timm's ``BatchNormAct2d``), when it computes ``act(batch_norm(x))`` in train and in eval
  mode, running statistics and ``num_batches_tracked`` included (``opsnn_lab.ops._bn_act``, the check the
  fused op itself makes): it runs as a BatchNorm, and ``Probed.bn_act`` names the act it applies;
* a ``GroupNorm`` subclass of that shape (timm's ``GroupNormAct``: ResNetV2-BiT's, RegNet's) when it computes
  ``act(group_norm(x))`` on a probe: it runs as a GroupNorm, its act named the same way;
* an ``nn.PReLU`` subclass with its own forward (timm's ``PReLU``, calling ``F.prelu`` itself) that computes PReLU
  with its weight on a probe (``ops._activations.is_prelu``): it runs as a PReLU, which a norm may apply itself;
* a ``Conv2d`` subclass without padding of its own whose forward pads TensorFlow's 'same' way for each input size
  (timm's ``Conv2dSame`` in its ``tf_*`` models, EfficientNet-PyTorch's ``Conv2dDynamicSamePadding``), checked on
  three map sizes (every residue of a stride 2 or 3): it runs as a Conv2d, which ``FusedConvBNAct(pad_same=True)``
  fuses. A conv padding a fixed amount whatever the size (``Conv2dStaticSamePadding`` at a stride over 1) differs
  on one of them and is looked into.

Probes call ``forward`` (the user's hooks do not fire) under ``no_grad`` and ``fork_rng`` (their RNG stream
does not move); a BatchNorm's buffers and mode are restored after its probe, and every module's plain attributes
after all probes. A module whose probe raises or
differs is looked into, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.fusion.graph import ACTIVATIONS, Probed, _hf_op, canonical_module, own_forward
from opsnn_lab.fusion.instance import instance_state, restore_instance_state
from opsnn_lab.ops._activations import is_prelu
from opsnn_lab.ops._bn_act import PROBE_RTOL, computes_batch_norm, inner_activation, probe_matches
from opsnn_lab.ops._conv_bn_args import ntuple, same_pads
from opsnn_lab.ops._mlp_parts import activation_name, exact_in_float64

__all__ = ["probe_modules"]


def _quiet(device: torch.device):
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _probe_input(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(like.device, like.dtype)


def _usable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in PROBE_RTOL and t.device.type != "meta"


def _computes_linear(module: nn.Linear) -> bool:
    w, b = module.weight, module.bias
    if not _usable(w) or w.dim() != 2:
        return False
    x = _probe_input((5, w.shape[1]), w)
    try:
        with torch.no_grad(), _quiet(w.device):
            return probe_matches(module.forward(x), F.linear(x, w, b))
    except Exception:  # noqa: BLE001 - a forward that cannot take a plain (5, in) tensor is not a Linear
        return False


def _computes_same_conv(conv: nn.Conv2d) -> bool:
    """Whether ``conv``'s own forward is ``conv2d(pad_same(x), ...)`` with no padding of its own, at three sizes."""
    w = conv.weight
    if not _usable(w) or conv.padding_mode != "zeros" or isinstance(conv.padding, str) or \
            ntuple(conv.padding, 2) != (0, 0):
        return False
    try:
        with torch.no_grad(), _quiet(w.device):
            for size in ((9, 6), (8, 11), (7, 10)):  # every residue of a stride 2 or 3 along each side
                x = _probe_input((1, conv.in_channels, *size), w)
                pads = same_pads(size, conv.kernel_size, conv.stride, conv.dilation)
                want = F.conv2d(F.pad(x, pads), w, conv.bias, conv.stride, 0, conv.dilation, conv.groups)
                if not probe_matches(conv.forward(x), want):
                    return False
        return True
    except Exception:  # noqa: BLE001 - a forward that cannot take a plain map is not this conv
        return False


def _bare(module: nn.Module) -> bool:
    """No parameters, buffers or children: all it can compute is a function of its input."""
    return not (module._parameters or module._buffers or module._modules)


def _unknown(module: nn.Module) -> bool:
    builtin = type(module).__module__.startswith(("torch.", "opsnn_lab."))
    return not builtin and _hf_op(module) is None and canonical_module(module) not in ACTIVATIONS


def probe_modules(model: nn.Module) -> None:
    """Mark what ``model``'s own classes compute (see the module docstring); cheap to call again. What a probed
    forward writes in its module (a causal conv's cache of frames for its next call) is put back after."""
    state = instance_state(model)
    try:
        _probe_modules(model)
    finally:
        restore_instance_state(state)


def _probe_modules(model: nn.Module) -> None:
    norms = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and own_forward(m) is not nn.Linear:
            if m not in Probed.linear and _computes_linear(m):
                Probed.linear.add(m)
        elif isinstance(m, nn.Conv2d) and own_forward(m) is not nn.Conv2d:
            if m not in Probed.same_conv and _computes_same_conv(m):
                Probed.same_conv.add(m)
        elif isinstance(m, nn.PReLU) and own_forward(m) is not nn.PReLU and m not in Probed.activation:
            if is_prelu(m):
                Probed.activation[m] = "prelu"
        elif _bare(m) and _unknown(m) and m not in Probed.activation:
            name, _ = activation_name(m)
            if name is not None:
                Probed.activation[m] = name
                if not exact_in_float64(m, name):
                    Probed.float32_inside.add(m)
        elif _norm_subclass(m) and m not in Probed.bn_act:
            norms.append(m)
    for m in norms:  # after the activations: the act child may be one probed above
        ok, act = inner_activation(m)
        if not ok or (act is not None and canonical_module(act) not in _INNER_ACTS):
            continue
        if _computes_group_norm(m, act) if isinstance(m, nn.GroupNorm) else computes_batch_norm(m, act):
            Probed.bn_act[m] = act


# what a norm module may apply itself: the pointwise activations, and a PReLU (the norm-act and conv-bn ops train its
# weight; it is no graph ACTIVATION, which the gated rows would read as an activation of a gate)
_INNER_ACTS = ACTIVATIONS | {"prelu"}


def _norm_subclass(m: nn.Module) -> bool:
    """A BatchNorm2d or GroupNorm subclass with a forward of its own."""
    base = next((b for b in (nn.BatchNorm2d, nn.GroupNorm) if isinstance(m, b)), None)
    return base is not None and own_forward(m) is not own_forward(base)


def _computes_group_norm(norm: nn.GroupNorm, act: nn.Module | None) -> bool:
    """Whether ``norm``'s forward computes ``act(F.group_norm(x))`` (the norm alone with ``act=None``)."""
    like = norm.weight if norm.weight is not None else torch.zeros(())
    if not _usable(like):
        return False
    x = _probe_input((2, norm.num_channels, 3, 3), like)
    try:
        with torch.no_grad(), _quiet(x.device):
            ref = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
            return probe_matches(norm.forward(x.clone()), act(ref) if act is not None else ref)
    except Exception:  # noqa: BLE001 - a forward that cannot take a plain (2, C, 3, 3) map is not this norm
        return False
