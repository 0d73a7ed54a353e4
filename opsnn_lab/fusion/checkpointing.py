"""Models with activation checkpointing on (Hugging Face's ``gradient_checkpointing_enable()``).

A checkpointed layer keeps nothing past its forward: its activations are dropped and computed again in backward,
so a trace recorded with checkpointing on sees no tensor saved inside it, and every chain there reads as keeping
more fused than eager's nothing (the fused op's saves were measured outside the checkpoint). The analysis records
with the flags off (``suspended``), so each chain is weighed on what the layer's forward, and its recompute in
backward, actually computes; the fused layer runs under the same checkpoint (``region_forward``, or the layer's own
wrapper around module-level ops). Across the step a chain inside such a layer then saves nothing, fused or not:
``settle`` says so on its decision and leaves its bytes out of the plan's totals, which stay what a step of the
checkpointed model keeps (``ol.measuring.activation_bytes``).
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["suspended", "inside", "settle"]


@contextlib.contextmanager
def suspended(model: nn.Module):
    """Every ``gradient_checkpointing`` flag of the model off inside the block; yields the paths of the modules
    that checkpoint (``_units``)."""
    on = {path: m for path, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True}
    for m in on.values():
        m.gradient_checkpointing = False
    try:
        yield _units(on)
    finally:
        for m in on.values():
            m.gradient_checkpointing = True


def _units(on: dict[str, nn.Module]) -> tuple[str, ...]:
    """Of the modules with the flag on, those that run checkpointed: Hugging Face's layers (its
    ``GradientCheckpointingLayer``, whose forward wrapper checkpoints; the model above them holds the flag too, for
    its cache settings), else the innermost flagged modules (a stack whose loop checkpoints each layer it calls)."""
    layers = [p for p, m in on.items() if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    if layers:
        return tuple(layers)
    return tuple(p for p in on if not any(q != p and q.startswith(f"{p}.") for q in on))


def _holder(scope: str, paths: tuple[str, ...]) -> str | None:
    return next((p for p in paths if scope == p or scope.startswith(f"{p}.") or not p), None)


def inside(graph, paths: tuple[str, ...]) -> dict[str, str]:
    """``{node name: the checkpointed module it runs in}`` for the trace's nodes inside those modules."""
    if not paths:
        return {}
    found = {n.name: _holder(n.scope or "", paths) for n in graph.nodes}
    return {name: path for name, path in found.items() if path is not None}


def settle(decisions, nodes: dict[str, str]) -> None:
    """A decision of a chain inside a checkpointed module saves nothing across the step: its ``saved_bytes`` go to
    0 and its reason says why, with what the fused chain saves in the layer's recompute."""
    for d in decisions:
        path = next((nodes[n] for n in d.nodes if n in nodes), None)
        if path is None or (not d.fused and not d.saved_bytes):
            continue
        recompute = (f"; fused, the recompute keeps {d.saved_bytes:,} activation bytes less" if d.saved_bytes > 0
                     else "")
        d.reason += (f"; `{path or '<model>'}` runs under gradient checkpointing: the chain's activations are dropped "
                     f"after its forward and computed again in backward, fused or not (0 bytes across the step)"
                     f"{recompute}")
        d.saved_bytes = 0
