"""The counter-RNG streams of a model, by name: its ``CounterRNG`` modules and the fused ops a rewrite runs in their
place, named after the dropout module each absorbed, as ``make_reproducible`` (``seed_pool``) seeds them."""

from __future__ import annotations

from torch import nn

__all__ = ["ROOT", "counter_streams", "name_hosts", "link_streams"]

ROOT = "<root>"  # the name of the model itself in functional-dropout keys


def _fused_op(module: nn.Module):
    """The op a fusion rewrite runs for ``module``: the ``op`` of its instance-``forward`` patch (module-level
    routes) or of itself (the fx route's slot), or None."""
    patch = module.__dict__.get("forward")
    return getattr(patch, "op", None) if patch is not None else module.__dict__.get("op")


def counter_streams(model: nn.Module):
    """``(name, module)`` for every counter-RNG stream of ``model``: its ``CounterRNG`` modules, and the
    fused ops a fusion rewrite runs in their place (they are not children), named after the dropout module
    they absorbed (``op.rng_name``, seen from ``model``: the same masks as that module's, fused or not), else
    ``"<host path>:fused"``."""
    from opsnn_lab.ops.dropout import CounterRNG

    for name, module in model.named_modules():
        if isinstance(module, CounterRNG):
            yield name or ROOT, module
        op = _fused_op(module)
        if isinstance(op, CounterRNG):
            yield _absorbed_name(op, name) or f"{name or ROOT}:fused", op


def name_hosts(fused: nn.Module) -> None:
    """Record in each fused op of ``fused`` that names an absorbed stream where its host module is
    (``op.rng_host``): ``op.rng_name`` is a path in ``fused``, and ``counter_streams`` of a model that holds
    ``fused`` (a wrapper, DDP's ``module.``) or of a part of it reads that path from there."""
    for name, module in fused.named_modules():
        op = _fused_op(module)
        if op is not None and getattr(op, "rng_name", None):
            op.rng_host = name


def _absorbed_name(op: nn.Module, host: str) -> str | None:
    """``op.rng_name`` seen from the model being walked, where the op's host module is at ``host``; None if the
    absorbed module lies outside that model (or the op absorbed none)."""
    name, at = getattr(op, "rng_name", None), op.__dict__.get("rng_host")
    if not name or at is None or at == host:
        return name
    path, colon, call = name.partition(":")
    path = "" if path == ROOT else path
    if not at or host.endswith("." + at):  # walked from a model holding the fused one: its path in front
        above = host[:len(host) - len(at)].rstrip(".")
        path = ".".join(p for p in (above, path) if p)
    elif not host or at.endswith("." + host):  # walked from a part of it: that part's path taken off
        below = at[:len(at) - len(host)].rstrip(".")
        if path != below and not path.startswith(below + "."):
            return None
        path = path[len(below):].lstrip(".")
    else:
        return None
    return f"{path or ROOT}{colon}{call}" if colon else path or ROOT


def link_streams(streams):
    """``streams`` (``(name, module)`` pairs) as a list, each module drawing from the first one of its name: a
    dropout module called twice, once by itself and once inside the fused op that absorbed it, takes turns on
    one counter, as the module alone does in the unfused model. A fused op that absorbed an inline
    ``F.dropout`` draws that call's key under its name here (``rng_stream``)."""
    streams, first = list(streams), {}
    for name, module in streams:
        module.share_rng(first.setdefault(name, module))
        if ":dropout." in name:
            module.rng_stream = name
    return streams


def _replace_dropouts(model: nn.Module) -> int:
    from opsnn_lab.ops.dropout import Dropout

    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if "forward" in child.__dict__:  # rewritten by fusion: its dropout runs in the fused op (seeded)
                continue
            if type(child) is nn.Dropout:  # Dropout1d/2d/3d drop whole channels: a different mask shape
                setattr(module, child_name, Dropout.from_module(child, seed=0))
                replaced += 1
    return replaced
