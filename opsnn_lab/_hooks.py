"""Module hooks as opsnn_lab tells them apart: whether a module has hooks that need its own call to fire.

A fused region's fx code runs some submodules' forwards inline (no module call), so their hooks would not fire;
the region falls back to its original forward when such a module has hooks (``fusion.rewrite.FxForward``), as a
fused chain does when one of its modules has (``fusion.staleness.hooked``). opsnn_lab's own hooks that only name or
measure what runs are marked ``passive`` and do not count. Hugging Face's output-capturing hooks (installed on a
model's first call asking for ``output_hidden_states`` / ``output_attentions``, and kept) count at run time only in
a call that collects what they record (``hooks_in_effect``); the analysis counts them always (``has_hooks``), so fx
code keeps those layers as calls and the fused code records them.
"""

from __future__ import annotations

import functools
import sys

from torch import nn

__all__ = ["passive", "has_hooks", "hooks_in_effect"]

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
    return next(_own_hooks(module), None) is not None


def _own_hooks(module: nn.Module):
    """``module``'s forward, forward-pre and backward hooks, opsnn_lab's passive ones left out."""
    return (h for k in _HOOK_DICTS for h in getattr(module, k, {}).values() if not getattr(h, "opsnn_passive", False))


_HF_CAPTURE_MODULE = "transformers.utils.output_capturing"


def _capture_key(hook) -> tuple[bool, object]:
    """``(True, key)`` for a Hugging Face output-capturing hook (``key``: what it records, None if unknown), else
    ``(False, None)``."""
    if getattr(hook, "__module__", None) != _HF_CAPTURE_MODULE or \
            not getattr(hook, "__qualname__", "").endswith("output_capturing_hook"):
        return False, None
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    return True, cells[names.index("key")].cell_contents if "key" in names and len(cells) == len(names) else None


def _collecting(key) -> bool:
    """Whether this call collects what a Hugging Face capturing hook with ``key`` records."""
    var = getattr(sys.modules.get(_HF_CAPTURE_MODULE), "_active_collector", None)
    try:
        collected = var.get() if var is not None else None
    except LookupError:
        return False
    return collected is not None and (key is None or key in collected)


def hooks_in_effect(module: nn.Module) -> str:
    """What of ``module``'s own hooks needs its own call now: "user" (a hook of the user's or a library's),
    "capture" (only Hugging Face's output capture, in a call that collects what it records), '' (none: no hooks,
    opsnn_lab's passive ones, Hugging Face's capture in a call that collects nothing of it)."""
    found = ""
    for h in _own_hooks(module):
        capture, key = _capture_key(h)
        if not capture:
            return "user"
        if _collecting(key):
            found = "capture"
    return found
