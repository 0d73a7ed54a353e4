"""A forward wrapped by a decorator that takes ``(self, *args, **kwargs)`` (``functools.wraps``): fx builds its
placeholders from the wrapper's code and cannot trace it (Hugging Face wraps every layer's forward for gradient
checkpointing, and attention forwards for hub kernels). Such a forward is traced as the function it wraps when,
on the example call, the wrapper returns what that function returns: the same structure and the same bits,
each run from the same RNG state and with the module's buffers and attributes as they were.

The rewritten forward then runs without the wrapper. What a wrapper adds only in some calls is kept by the
guards: a call the trace was not specialised for runs the original (wrapper included), and so does a module
whose ``gradient_checkpointing`` flag is on (the wrapper would checkpoint it; see ``rewrite.FxForward``).

The replay needs the call's arguments as they were. A key/value cache passed to every layer (Hugging Face's
decoders with ``use_cache=True``, the default even in training) has grown by each later layer's keys by the time
the check runs; replayed on it, a layer attends over keys it never saw and, with a padding mask, raises.
``ArgumentState`` keeps, at the call, what such objects held (their attributes and their containers' items, by
reference: a growing cache rebinds its tensors, ``torch.cat``), and the replay runs from it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import types

import torch
from torch import nn

__all__ = ["forward_wrapper", "unwrapped_forward", "passes_through", "ArgumentState", "RecordedCall", "holds_tensors"]


def forward_wrapper(module: nn.Module) -> str:
    """The qualified name of the ``*args``/``**kwargs`` wrapper around ``type(module).forward``, or ''."""
    fwd = type(module).forward
    if not isinstance(fwd, types.FunctionType) or inspect.unwrap(fwd) is fwd:
        return ""
    if not fwd.__code__.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        return ""
    code = fwd.__code__  # the wrapper's own (functools.wraps gave it the wrapped function's names)
    return f"{getattr(code, 'co_qualname', code.co_name)} ({os.path.basename(code.co_filename)})"


@contextlib.contextmanager
def unwrapped_forward(module: nn.Module):
    """``type(module).forward`` is the function it wraps inside the block (for fx), the wrapper again after."""
    cls = type(module)
    own = cls.__dict__.get("forward")
    cls.forward = inspect.unwrap(cls.forward)
    try:
        yield
    finally:
        if own is None:
            del cls.forward  # it was inherited
        else:
            cls.forward = own


def holds_tensors(value) -> bool:
    """An object (not a tensor or a container of tensors alone) whose attributes hold tensors: a cache."""
    attrs = getattr(value, "__dict__", None)
    if not attrs or isinstance(value, nn.Module):
        return False
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(
        isinstance(x, torch.Tensor) or holds_tensors(x) for x in v)) for v in attrs.values())


_OPAQUE = (torch.Tensor, nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, torch.dtype, torch.device, str, bytes, int, float, complex, bool, type(None))


class ArgumentState:
    """What the objects among ``values`` held, taken now: each object's attributes and each list's, dict's and
    set's items, by reference (tensors are not copied), down to ``limit`` objects. ``restore()`` puts them back,
    so a cache is as it was here (what it held in place, a static cache's tensors written since, is not undone).
    ``complete`` is False when the objects were too many to keep (``restore`` then keeps what it has)."""

    def __init__(self, values, limit: int = 10000):
        self.items: list[tuple[object, object]] = []  # (object, its attributes or items as they were)
        self.complete = True
        seen: set[int] = set()
        stack = [v for v in values if not isinstance(v, _OPAQUE)]
        while stack:
            value = stack.pop()
            if id(value) in seen or isinstance(value, _OPAQUE):
                continue
            if len(seen) >= limit:
                self.complete = False
                break
            seen.add(id(value))
            if isinstance(value, (list, dict, set)):
                kept = copy.copy(value)
                inner = list(value.values()) if isinstance(value, dict) else list(value)
            elif isinstance(value, tuple):
                kept, inner = None, list(value)
            elif isinstance(getattr(value, "__dict__", None), dict):
                kept = dict(value.__dict__)
                inner = list(kept.values())
            else:
                continue
            if kept is not None:
                self.items.append((value, kept))
            stack.extend(inner)

    def restore(self) -> None:
        for value, kept in self.items:
            if isinstance(value, (list, dict, set)):
                value.clear()
                if isinstance(value, list):
                    value.extend(kept)
                else:
                    value.update(kept)
            else:
                value.__dict__.clear()
                value.__dict__.update(kept)


class RecordedCall(tuple):
    """``(args, kwargs)`` of a recorded module call; ``state``: the ``ArgumentState`` of its non-tensor
    arguments when the call began (None when not taken); ``bare``: it returned one tensor (set when it returns)."""

    def __new__(cls, args: tuple, kwargs: dict, state: ArgumentState | None = None):
        call = super().__new__(cls, (args, kwargs))
        call.state, call.bare = state, False
        return call

    def __reduce__(self):  # copy and pickle: the state is left out (it holds the objects by reference)
        return RecordedCall, tuple(self)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).logical_or(a.isnan() & b.isnan()).all())
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not known to be the same
        return False


def passes_through(module: nn.Module, call, restore) -> str:
    """'' when the wrapper and the function it wraps return the same on ``call`` (``(args, kwargs)``), else how
    they did not: ``"other values"``, or the error a replay of the call raised.

    Both run under ``no_grad`` from one RNG state; ``restore()`` puts the module's attributes back after each
    run, and its buffers (a BatchNorm's statistics) are put back here. A replay sees the call's objects as they
    are now, unless ``call`` is a ``RecordedCall`` with a state: then each replay starts from the state the call's
    objects had (a key/value cache before this layer's keys), and they are put back as they are now after."""
    args, kwargs = call
    then = getattr(call, "state", None)
    now = ArgumentState([*args, *kwargs.values()]) if then is not None else None
    fwd = type(module).forward
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    tensors = [*module.parameters(), *module.buffers()]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    outs = []
    try:
        for fn in (fwd, inspect.unwrap(fwd)):
            if then is not None:
                then.restore()
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(0)
                outs.append(fn(module, *args, **kwargs))
            restore()
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
    except Exception as exc:  # noqa: BLE001 - either failing: not shown to pass through
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if now is not None:
            now.restore()
    return "" if _same(*outs) else "other values"
