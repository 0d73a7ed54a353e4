"""A module tree's plain attributes, saved and put back: what a forward run for tracing or probing writes in
``self`` (a cache, a causal conv's frames for its next call) must not stay behind."""

from __future__ import annotations

import copy

from torch import nn

__all__ = ["instance_state", "restore_instance_state"]


# nn.Module's own bookkeeping, restored by other means (flags) or never touched by a forward
_MODULE_KEYS = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
                          "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_state_dict_pre_hooks",
                          "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                          "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook"})


def instance_state(module: nn.Module) -> list:
    """Each module's plain attributes, with a shallow copy of each dict, list or set (a cache filled in place)."""
    out = []
    for m in module.modules():
        attrs = {k: (v, copy.copy(v) if type(v) in (dict, list, set) else None)
                 for k, v in m.__dict__.items() if k not in _MODULE_KEYS}
        out.append((m, attrs))
    return out


def restore_instance_state(state: list) -> None:
    for m, attrs in state:
        for k in [k for k in m.__dict__ if k not in _MODULE_KEYS and k not in attrs]:
            del m.__dict__[k]
        for k, (value, contents) in attrs.items():
            m.__dict__[k] = value
            if contents is None:
                continue
            value.clear()  # refilled as it was (no == on contents: they may hold tensors)
            if isinstance(value, list):
                value.extend(contents)
            else:
                value.update(contents)
