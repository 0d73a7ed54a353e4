"""The model a fused copy was made from, and the optimizer built on it before fusion.

``fuse`` returns a copy and leaves the model as it was, so an optimizer a training script built before it added
the fuse call holds the original model's Parameters: the fused copy runs and gets the gradients, the optimizer
steps tensors without one (skipped), and nothing trains, without an error. ``remember(model, fused)`` keeps each
original Parameter's fused twin (weakly); a global optimizer step pre-hook looks at each optimizer's first step and
warns once where it holds originals without a gradient whose twins have one. After that first step an optimizer
costs a set lookup per step.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

__all__ = ["remember"]

_TWINS: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(original Parameter) -> (original, fused twin)
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose first step was looked at
_HOOK: list = []


def remember(model: nn.Module, fused: nn.Module) -> None:
    """Keep, weakly, the twin in ``fused`` of each Parameter of ``model`` (matched by name)."""
    for key in [k for k, (p, q) in _TWINS.items() if p() is None or q() is None]:
        del _TWINS[key]
    twins = dict(fused.named_parameters())
    for name, p in model.named_parameters():
        q = twins.get(name)
        if q is not None and q is not p:
            _TWINS[id(p)] = (weakref.ref(p), weakref.ref(q))
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            pair = _TWINS.get(id(p))
            if pair is None or pair[0]() is not p:
                continue
            twin = pair[1]()
            if twin is not None and p.grad is None and twin.grad is not None:
                warnings.warn(f"opsnn_lab.fusion: this {type(optimizer).__name__} steps the Parameters of a model "
                              "that was fused, but the fused model is a copy (`fuse` leaves the model as it was): it "
                              "ran the backward, its Parameters hold the gradients, and this optimizer does not hold "
                              "them, so nothing trains. Build the optimizer on `fused.parameters()` (or fuse before "
                              "building it)", RuntimeWarning, stacklevel=3)
                return
