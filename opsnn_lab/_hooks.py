"""Module hooks as opsnn_lab tells them apart: whether a module has hooks that need its own call to fire.

A fused region's fx code runs some submodules' forwards inline (no module call), so their hooks would not fire;
the region falls back to its original forward when such a module has hooks (``fusion.rewrite.FxForward``).
opsnn_lab's own hooks that only name or measure what runs are marked ``passive`` and do not count.
"""

from __future__ import annotations

import functools

from torch import nn

__all__ = ["passive", "has_hooks"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def passive(hook):
    """Mark a hook of opsnn_lab's own that needs no module call of its own to be right (it names or measures what
    runs): a region's fx code may inline the module it sits on, and it does not make the region fall back."""
    hook = functools.partial(hook)
    hook.opsnn_passive = True
    return hook


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward, forward-pre or backward hooks of its own, opsnn_lab's passive ones aside
    (fx code inlining its forward would skip them)."""
    return any(not getattr(h, "opsnn_passive", False) for k in _HOOK_DICTS for h in getattr(module, k, {}).values())
