"""``fuse(model, example_inputs)``: analyse and apply in one call."""

from __future__ import annotations

from torch import nn

from opsnn_lab.fusion import originals
from opsnn_lab.fusion.analysis import analyze
from opsnn_lab.fusion.plan import FusionPlan
from opsnn_lab.fusion.rewrite import apply

__all__ = ["fuse"]


def fuse(model: nn.Module, example_inputs, patterns=None) -> tuple[nn.Module, FusionPlan]:
    """``(fused_model, plan)``; ``model`` is left untouched: ``fused_model`` is a copy with Parameters of its own,
    so build the optimizer on ``fused_model.parameters()`` (an optimizer built before on ``model``'s is told at its
    first step: originals.py)."""
    plan = analyze(model, example_inputs, patterns)
    fused = apply(model, plan)
    originals.remember(model, fused)
    return fused, plan
