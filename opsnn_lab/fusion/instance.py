"""A module tree's plain attributes, saved and put back: what a forward run for tracing or probing writes in
``self`` (a cache, a causal conv's frames for its next call) must not stay behind."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import types

import torch
from torch import nn

__all__ = ["instance_state", "restore_instance_state", "plain_object", "host_rngs", "dropout_streams"]


# nn.Module's own bookkeeping, restored by other means (flags) or never touched by a forward
_MODULE_KEYS = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
                          "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_state_dict_pre_hooks",
                          "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                          "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook"})


_CONTAINERS = (dict, list, set, collections.OrderedDict, collections.defaultdict)  # refilled in place (exact types)
_NOT_HOLDERS = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
                types.BuiltinFunctionType, functools.partial)


def _attrs(d: dict, skip=frozenset()) -> dict:
    return {k: (v, copy.copy(v) if type(v) in _CONTAINERS else None) for k, v in d.items() if k not in skip}


def plain_object(v) -> bool:
    """A plain Python object with instance attributes (a cache around an OrderedDict, a config): not a module, a
    tensor, a class, a function or a Python module, whose attributes are no state a forward writes."""
    return not isinstance(v, _NOT_HOLDERS) and isinstance(getattr(v, "__dict__", None), dict)


def instance_state(module: nn.Module) -> list:
    """Each module's plain attributes, with a shallow copy of each dict, list or set (a cache filled in place); and
    those of the plain objects the modules hold (OmDet-Turbo's LRU cache of text embeddings, which a forward fills
    with tensors still holding their autograd graph)."""
    out, seen = [], set()
    for m in module.modules():
        out.append((m, _attrs(m.__dict__, _MODULE_KEYS)))
        for v in list(m.__dict__.values()):
            if plain_object(v) and id(v) not in seen:
                seen.add(id(v))
                out.append((v, _attrs(vars(v))))
    return out


def restore_instance_state(state: list) -> None:
    for m, attrs in state:
        d = m.__dict__
        skip = _MODULE_KEYS if isinstance(m, nn.Module) else ()
        for k in [k for k in d if k not in skip and k not in attrs]:
            del d[k]
        for k, (value, contents) in attrs.items():
            d[k] = value
            if contents is None:
                continue
            value.clear()  # refilled as it was (no == on contents: they may hold tensors)
            if isinstance(value, list):
                value.extend(contents)
            else:
                value.update(contents)


@contextlib.contextmanager
def host_rngs():
    """Python's and numpy's global RNG as they were, afterwards (``torch.random.fork_rng`` does torch's)."""
    from opsnn_lab.consistency.functional import foreign_states, restore_foreign_states

    states = foreign_states()
    try:
        yield
    finally:
        restore_foreign_states(states)


def dropout_streams(model: nn.Module):
    """A function restoring where the model's dropout streams are: each counter-RNG module's seed and step,
    and the step of ``ol.consistency.make_reproducible`` (the traced forward must not advance them)."""
    from opsnn_lab.consistency.seed_pool import get_step, set_step
    from opsnn_lab.consistency.streams import counter_streams

    kept = [(m, m.rng_seed, m.rng_step) for _, m in counter_streams(model)]
    step = get_step(model) if getattr(model, "_opsnn_reproducible", None) is not None else None

    def restore() -> None:
        for m, seed, at in kept:
            m.set_rng(seed, at)
        if step is not None:
            set_step(model, step)

    return restore
