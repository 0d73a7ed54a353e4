"""A forward wrapped by a decorator that takes ``(self, *args, **kwargs)`` (``functools.wraps``): fx builds its
placeholders from the wrapper's code and cannot trace it (Hugging Face wraps every layer's forward for gradient
checkpointing, and attention forwards for hub kernels). Such a forward is traced as the function it wraps when,
on the example call, the wrapper returns what that function returns: the same structure and the same bits,
each run from the same RNG state and with the module's buffers and attributes as they were.

The rewritten forward then runs without the wrapper. What a wrapper adds only in some calls is kept by the
guards: a call the trace was not specialised for runs the original (wrapper included), and so does a module
whose ``gradient_checkpointing`` flag is on (the wrapper would checkpoint it; see ``rewrite.FxForward``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types

import torch
from torch import nn

__all__ = ["forward_wrapper", "unwrapped_forward", "passes_through"]


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
    are now: an argument the model updated in place after the call (a key/value cache that grew by this layer's
    keys) makes the replay fail, and the forward stays untraced."""
    args, kwargs = call
    fwd = type(module).forward
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    tensors = [*module.parameters(), *module.buffers()]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    outs = []
    try:
        for fn in (fwd, inspect.unwrap(fwd)):
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(0)
                outs.append(fn(module, *args, **kwargs))
            restore()
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
    except Exception as exc:  # noqa: BLE001 - either failing: not shown to pass through
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "" if _same(*outs) else "other values"
