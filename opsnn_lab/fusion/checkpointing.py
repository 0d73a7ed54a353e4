"""Models with activation checkpointing on (Hugging Face's ``gradient_checkpointing_enable()``, diffusers'
``enable_gradient_checkpointing()``, FSDP's ``apply_activation_checkpointing``, ``checkpoint_sequential``, or
``torch.utils.checkpoint`` calls in a forward: timm's ``set_grad_checkpointing()``, a user's own).

A checkpointed layer keeps nothing past its forward: its activations are dropped and computed again in backward,
so a trace recorded with checkpointing on sees no tensor saved inside it, and every chain there reads as keeping
more fused than eager's nothing (the fused op's saves were measured outside the checkpoint). The analysis records
with the Hugging Face layers' flags off (``suspended``; back on for the regions' fx traces, which then meet the
checkpoints as the rewrite does) and with ``torch.utils.checkpoint`` running the function it is given as it is
(``transparent``, which marks what ran inside), so each chain is weighed on what the layer's forward, and its
recompute in backward, actually computes; the fused layer runs under the same checkpoint (``region_forward``, the
layer's own wrapper around module-level ops, or the model's own checkpoint call). Across the step a chain inside
such a layer then saves nothing, fused or not: ``settle`` says so on its decision and leaves its bytes out of the
plan's totals, which stay what a step of the checkpointed model keeps (``ol.measuring.activation_bytes``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

__all__ = ["suspended", "transparent", "refused", "current", "saving_inputs", "save_inputs", "holder", "inside",
           "crossing", "settle"]

_CALLS: list[int] = []  # the torch.utils.checkpoint calls running, inside ``transparent`` (innermost last)
_COUNT = [0]
_INPUT_SAVERS: list = []  # who records the inputs a checkpoint keeps (``saving_inputs``)


@contextlib.contextmanager
def saving_inputs(save):
    """``save(tensor)`` for each tensor argument of a checkpoint call run inside ``transparent``, and of each call of
    a layer whose checkpointing ``suspended`` turned off (``save_inputs``): a checkpoint keeps its inputs for its
    backward (both kinds save them as an autograd Function's), where nothing inside it keeps anything."""
    _INPUT_SAVERS.append(save)
    try:
        yield
    finally:
        _INPUT_SAVERS.remove(save)


@contextlib.contextmanager
def suspended(model: nn.Module):
    """The ``gradient_checkpointing`` flag of each Hugging Face layer that checkpoints its whole call (its
    ``GradientCheckpointingLayer``) off inside the block; yields their paths. Other flagged modules keep their flag:
    what the flag does there is the module's own code (a stack's loop checkpointing each layer it calls, a diffusers
    block checkpointing its resnets and attentions but not its downsampler, a model its blocks and not its
    embeddings), and the checkpoint calls that code makes run plain under ``transparent``, each numbered, so the
    record marks exactly what ran inside one."""
    on = {path: m for path, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True
          and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)}
    for m in on.values():
        m.gradient_checkpointing = False
    try:
        yield tuple(on)
    finally:
        for m in on.values():
            m.gradient_checkpointing = True


def current() -> int | None:
    """The outermost ``torch.utils.checkpoint`` call running (numbered from 1 inside ``transparent``), else None."""
    return _CALLS[0] if _CALLS else None


@contextlib.contextmanager
def _call():
    _COUNT[0] += 1
    _CALLS.append(_COUNT[0])
    try:
        yield
    finally:
        _CALLS.pop()


class _Reentrant:
    """``CheckpointFunction`` (reentrant checkpointing) run as the plain call, counted."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        save_inputs(args)
        with _call():
            return function(*args)


def _plain(*args, **kwargs):
    """``_checkpoint_without_reentrant_generator`` that sets nothing up: the function runs as it is, counted. The
    positional arguments are what it saves (its keyword arguments are held by the recompute's closure, as the
    caller's other locals are, and no saved-tensor hook sees them)."""
    save_inputs(args)
    with _call():
        yield


def save_inputs(values) -> None:
    """The tensors among ``values``, a checkpoint's inputs, to whoever records them (``saving_inputs``)."""
    if _CALLS or not torch.is_grad_enabled():  # an inner checkpoint's inputs are dropped with the outer one's
        return  # activations; without gradients a checkpoint runs its function as it is and keeps nothing
    for save in _INPUT_SAVERS:
        for t in values:
            if isinstance(t, torch.Tensor):
                save(t)


def _refuse(*args, **kwargs):
    from torch import fx

    raise fx.proxy.TraceError("the code calls torch.utils.checkpoint: traced, the checkpoint would be lost (fx records "
                              "the checkpointed function's ops inline); the modules it calls are traced on their own")


class _RefusedReentrant:
    apply = staticmethod(_refuse)


@contextlib.contextmanager
def refused():
    """``torch.utils.checkpoint`` raises fx's ``TraceError`` inside the block: fx would trace through it and record
    the checkpointed function's ops inline, so a rewritten forward would run them without the checkpoint (a timm
    ViT with ``set_grad_checkpointing()`` kept 54 MB more fused than eager). The region is then not traced whole;
    what it calls is, each module on its own, inside the model's own checkpoint call."""
    with _entry_points(_RefusedReentrant, _refuse):
        yield


@contextlib.contextmanager
def transparent():
    """``torch.utils.checkpoint.checkpoint`` runs the function it is given as it is inside the block (a trace then
    sees what it saves), ``current()`` numbering the calls running. On a torch whose checkpoint has not these two
    entry points, checkpoints stay as they are."""
    with _entry_points(_Reentrant, _plain):
        yield


@contextlib.contextmanager
def _entry_points(reentrant, plain):
    """torch.utils.checkpoint's two entry points replaced inside the block (left as they are on a torch that has
    not these two)."""
    names = ("CheckpointFunction", "_checkpoint_without_reentrant_generator")
    if not all(hasattr(_torch_checkpoint, n) for n in names):
        yield
        return
    saved = {n: getattr(_torch_checkpoint, n) for n in names}
    _torch_checkpoint.CheckpointFunction, _torch_checkpoint._checkpoint_without_reentrant_generator = reentrant, plain
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(_torch_checkpoint, n, v)


def holder(scope: str, paths: tuple[str, ...]) -> str | None:
    """The path among ``paths`` whose module runs the code of ``scope`` (a module path), else None."""
    return next((p for p in paths if scope == p or scope.startswith(f"{p}.") or not p), None)


def inside(graph, paths: tuple[str, ...], calls: dict | None = None) -> dict[str, str | int]:
    """``{node name: what checkpoints it}`` for the trace's nodes that run checkpointed: the path of the flagged
    module it runs in, or the number of the ``torch.utils.checkpoint`` call it ran inside (``calls``: the trace's
    ``checkpointed``)."""
    found = {n.name: holder(n.scope or "", paths) for n in graph.nodes} if paths else {}
    return {**(calls or {}), **{name: path for name, path in found.items() if path is not None}}


def crossing(m, units: dict) -> str:
    """Why the chain ``m`` cannot be one fused op under checkpointing ('' when it can): its steps run in two
    checkpointed units, or in one and outside it, and a fused op runs in one place."""
    where = {units.get(n.name) for n in m.nodes}
    if len(where) < 2:
        return ""
    named = sorted("outside any checkpoint" if u is None else f"`{u or '<model>'}`" if isinstance(u, str) else
                   f"torch.utils.checkpoint call {u}" for u in where)
    return f"{_CROSSING} ({', '.join(named)}); one fused op runs in one of them"


_CROSSING = "not fused: its steps run under different activation checkpoints"


def settle(decisions, nodes: dict[str, str | int]) -> None:
    """A decision of a chain inside a checkpointed module saves nothing across the step: its ``saved_bytes`` go to
    0 and its reason says why, with what the fused chain saves in the layer's recompute."""
    for d in decisions:
        held = [n for n in d.nodes if n in nodes]
        if not held or (not d.fused and not d.saved_bytes):
            continue
        if d.reason.startswith(_CROSSING):
            d.saved_bytes = 0
            continue
        path = nodes[held[0]]
        where = f"`{path or '<model>'}` runs under gradient checkpointing" if isinstance(path, str) else \
            "runs inside a torch.utils.checkpoint call"
        recompute = (f"; fused, the recompute keeps {d.saved_bytes:,} activation bytes less" if d.saved_bytes > 0
                     else "")
        d.reason += (f"; {where}: the chain's activations are dropped after its forward and computed again in "
                     f"backward, fused or not (0 bytes across the step){recompute}")
        d.saved_bytes = 0
