"""The model a fused copy was made from, and the optimizer built on it before fusion.

``fuse`` returns a copy and leaves the model as it was, so an optimizer a training script built before it added
the fuse call holds the original model's Parameters: the fused copy runs and gets the gradients, the optimizer
steps tensors without one (skipped), and nothing trains, without an error. ``remember(model, fused)`` keeps each
original Parameter's fused twin (by name, the models weakly); a global optimizer step pre-hook looks at each
optimizer's first step and warns once where it holds originals without a gradient whose twins have one. After that
first step an optimizer costs a set lookup per step.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

__all__ = ["remember"]

_TWINS: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}  # id(original Parameter) -> (model, fused, name)
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose first step was looked at
_HOOK: list = []


def remember(model: nn.Module, fused: nn.Module) -> None:
    """Keep, weakly, ``model`` and its fused copy, and the name of each Parameter. The modules, not the
    Parameters: a weak reference to a Parameter makes ``torch.utils.swap_tensors`` refuse it (conversions under
    ``torch.__future__.set_swap_module_params_on_conversion``)."""
    for key in [k for k, (m, f, _) in _TWINS.items() if m() is None or f() is None]:
        del _TWINS[key]
    refs = weakref.ref(model), weakref.ref(fused)
    for name, p in model.named_parameters():
        _TWINS[id(p)] = (*refs, name)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def _twin(p):
    """The fused twin of ``p``, a Parameter of a model that was fused; None otherwise."""
    entry = _TWINS.get(id(p))
    if entry is None:
        return None
    model, fused, name = entry[0](), entry[1](), entry[2]
    if model is None or fused is None:
        return None
    try:
        if model.get_parameter(name) is not p:
            return None
        twin = fused.get_parameter(name)
    except AttributeError:  # a module or Parameter removed since
        return None
    return twin if twin is not p else None


def _first_step(optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            twin = _twin(p) if p.grad is None else None
            if twin is not None and twin.grad is not None:
                warnings.warn(f"opsnn_lab.fusion: this {type(optimizer).__name__} steps the Parameters of a model "
                              "that was fused, but the fused model is a copy (`fuse` leaves the model as it was): it "
                              "ran the backward, its Parameters hold the gradients, and this optimizer does not hold "
                              "them, so nothing trains. Build the optimizer on `fused.parameters()` (or fuse before "
                              "building it)", RuntimeWarning, stacklevel=3)
                return
