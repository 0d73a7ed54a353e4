"""What makes a fused chain's or region's code stale at a call: a hook added since fusion, a setting, a module or a
tensor it holds given another shape, a module in another mode than the fused code runs it in.

Each patch checks these at every call (about a microsecond for a chain) and runs its modules' own forwards while
one holds, with one warning; set back, it runs fused again (patch.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from opsnn_lab._hooks import hooks_in_effect

__all__ = ["hooked", "warn_hooked", "TensorShape", "settings", "drifted", "changed", "modal", "op_mode", "mode_change",
           "warn_changed", "qualified"]


def hooked(modules) -> tuple[nn.Module | None, str]:
    """The first of ``modules`` with a hook that needs the module's own call now, and what kind
    (``_hooks.hooks_in_effect``: "user", or "capture" for Hugging Face's output capture in a call that collects it);
    ``(None, '')`` when none has. Reads four dicts per module (~0.1 us each) and looks closer only where one is
    not empty."""
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            kind = hooks_in_effect(m)
            if kind:
                return m, kind
    return None, ""


def warn_hooked(patch, where: str, what: str, kind: str = "user") -> None:
    """Say once per patch that a hook added after fusion (on module ``where``) makes ``what`` (the chain, or the
    rewritten region) run unfused. Not for Hugging Face's output capture: a call asking for hidden states or
    attentions runs unfused, the others fused, as the user would want."""
    if patch.warned or kind != "user":
        return
    patch.warned = True
    warnings.warn(f"opsnn_lab.fusion: `{where or '<model>'}` has a hook added after {what} was fused; it runs "
                  "unfused (each module's own forward, so the hook sees the tensors it sees in eager) while the hook "
                  "is there, and saves no memory. Fusing again with the hook in place plans around that module",
                  RuntimeWarning, stacklevel=4)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(map(_plain, v)))


class TensorShape(tuple):
    """The shape a Parameter or buffer had at fusion (``settings``): the fused op, and a region's traced code, were
    made for it. ``seen``: the last Parameter found with it, so the check of an unchanged one is an identity test
    (a Parameter only: a module's own, never a caller's tensor with its graph; not a weak reference, which
    ``torch.utils.swap_tensors`` refuses; not pickled or copied)."""

    def __reduce__(self):
        return TensorShape, (tuple(self),)


def settings(modules, ops=()) -> tuple:
    """``(index, name, value)`` for each setting of ``modules`` that a rewrite may take as it is at fusion: every
    public attribute holding a plain value (a Dropout's ``p``, a norm's ``eps``, a drop path's rate, a
    ``self.scaling`` that traced code holds as a constant); and the shape of each Parameter and buffer
    (``TensorShape``). Another tensor of that shape in a module's place (a new ``nn.Parameter``,
    ``torch.func.functional_call``'s tensors, ``load_state_dict(assign=True)``) is what the fused op reads
    (owners.py); one of another shape is a change. ``training``, which the patches follow, a counter stream's
    ``rng_*`` state, and what one of the fused ``ops`` reads at every call (``op.live_settings()``: a BatchNorm's
    ``momentum``) are not settings."""
    live = {(id(m), k) for op in ops if hasattr(op, "live_settings") for m, k in op.live_settings()}
    plain = tuple((i, k, v) for i, m in enumerate(modules) for k, v in m.__dict__.items()
                  if k != "training" and not k.startswith(("_", "rng_")) and _plain(v) and (id(m), k) not in live)
    return plain + tuple((i, k, TensorShape(t.shape)) for i, m in enumerate(modules) for k, t in _tensors(m)
                         if t is not None)


def _tensors(m: nn.Module):
    return (*m.__dict__.get("_parameters", {}).items(), *m.__dict__.get("_buffers", {}).items())


def displaced(modules, places) -> tuple[int, str] | None:
    """The first of ``modules`` no longer where it was at fusion (``places``: its parent and attribute name there,
    None for the model itself), and ``"replaced by a `Linear` in its parent"``; None when each is in place (~0.05
    us each). A wrapper put in a chain step's place that calls the step inside (PEFT's LoRA ``Linear`` around an
    ``nn.Linear``) expects that step's own output, not the chain's."""
    for i, place in enumerate(places):
        if place is not None:
            now = place[0]._modules.get(place[1])
            if now is not modules[i]:
                by = f"a `{type(now).__name__}`" if now is not None else "nothing"
                return i, f"replaced by {by} in its parent"
    return None


def drifted(modules, recorded, recorded_settings) -> tuple[int, str] | None:
    """What makes fused code stale for ``modules`` (found now where ``recorded`` were at fusion): the first one
    replaced since (``make_reproducible``'s counter twin of a Dropout aside): its index and ``"replaced by a
    `LoraLinear`"``; else the first setting changed (``changed``)."""
    for i, (old, new) in enumerate(zip(recorded, modules)):
        if new is not old and not (isinstance(old, nn.Dropout) and hasattr(new, "next_draw")):
            return i, f"replaced by {'a `' + type(new).__name__ + '`' if new is not None else 'nothing'}"
    return changed(modules, recorded_settings)


def changed(modules, recorded) -> tuple[int, str] | None:
    """The first setting in ``recorded`` (from ``settings(modules)``) that ``modules`` no longer hold: the
    module's index and ``"a setting changed: p 0.5 -> 0.0"``; None when all hold (~0.1 us each). A tensor
    recorded itself (a patch pickled before shapes were recorded, whose ops hold no owner links) must still be
    that tensor."""
    for i, k, v in recorded:
        m = modules[i]
        if isinstance(v, (TensorShape, torch.Tensor)):
            now = m._parameters[k] if k in m._parameters else m._buffers[k] if k in m._buffers else \
                m.__dict__.get(k)
            if isinstance(v, torch.Tensor):
                if now is not v:
                    return i, (f"`{k}` is not the tensor it held at fusion, and this model was fused before fused "
                               "ops read their modules' tensors at each call: fusing it again lets them")
                continue
            if now is not None and v.__dict__.get("seen") is now:
                continue
            if not isinstance(now, torch.Tensor) or now.shape != v:
                got = f"of shape {tuple(now.shape)}" if isinstance(now, torch.Tensor) else "gone"
                return i, f"`{k}` is {got}, where the fused code was made for shape {tuple(v)}"
            if isinstance(now, nn.Parameter):
                v.seen = now
            continue
        now = m.__dict__.get(k, v)  # a twin swapped in without that attribute: not a change
        if now is not v and now != v:
            return i, f"a setting changed: {k} {v!r} -> {now!r}"
    return None


_MODAL = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)


def modal(m) -> bool:
    """Whether ``m``'s forward depends on its training flag in a way a fused op takes over: a Dropout, a BatchNorm,
    a counter-based twin."""
    return isinstance(m, _MODAL) or hasattr(m, "next_draw")


def op_mode(modules) -> tuple[bool, int | None]:
    """The training flag one fused op of ``modules`` (its host first) runs with: that of the modules whose forward
    depends on it (a Dropout, a BatchNorm, a counter-based twin: a BatchNorm frozen in eval mode inside a training
    model keeps its chain fused, in eval mode), else the host's; and the index of the first such module in another
    mode than the one before (None when they agree: one op cannot run both)."""
    mode = None
    for i, m in enumerate(modules):
        if m is not None and modal(m):
            if mode is not None and m.training != mode:
                return mode, i
            mode = m.training
    return (modules[0].training if mode is None else mode), None


def mode_change(modules, i: int) -> str:
    """What ``_odd_mode`` / ``op_mode`` found at module ``i``: ``"in eval mode, where the fused code runs it in
    training mode"``."""
    name = {True: "training", False: "eval"}
    return f"in {name[modules[i].training]} mode, where the fused code runs it in {name[not modules[i].training]} mode"


def warn_changed(patch, where: str, what: str, change: str) -> None:
    """Say once per patch that a module changed after fusion (``drifted``) makes ``what`` run unfused."""
    if patch.__dict__.get("warned_changed"):
        return
    patch.warned_changed = True
    warnings.warn(f"opsnn_lab.fusion: `{where or '<model>'}` changed after {what} was fused ({change}), and the "
                  "fused code holds it as it was; it runs unfused (each module's own forward, as it is now) while "
                  "that holds, and saves no memory. Fusing again fuses it as it is now", RuntimeWarning, stacklevel=4)


def qualified(host: nn.Module, path: str, module: nn.Module) -> str:
    """The qualified name of ``module`` inside ``host`` (itself at ``path``)."""
    name = next((n for n, m in host.named_modules() if m is module), "")
    return f"{path}.{name}" if path and name else (name or path)
