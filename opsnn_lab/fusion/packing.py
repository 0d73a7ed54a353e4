"""Packed projection weights (``FusedQKV``, ``FusedGatedMLP`` read theirs from one buffer) kept packed when the fused
model is converted or loaded, and the fused ops a model's patches run.
"""

from __future__ import annotations

from torch import nn

from opsnn_lab.fusion.patch_base import Patch

__all__ = ["fused_ops", "repack", "RepackAfterApply", "repack_after_load"]


def fused_ops(model: nn.Module) -> list[nn.Module]:
    """Every fused op the patches of ``model`` run, once each."""
    ops: dict[int, nn.Module] = {}
    for m in model.modules():
        patch = m.__dict__.get("forward")
        if isinstance(patch, Patch):
            ops.update((id(op), op) for op in patch.ops())
    return list(ops.values())


def repack(model: nn.Module) -> int:
    """Put the weights of each fused op of ``model`` that packs them (``FusedQKV``, ``FusedGatedMLP``) back into
    one buffer, where they share a dtype and a device; returns how many ops were unpacked before."""
    moved = [op for op in fused_ops(model) if hasattr(op, "repack") and not op.packed]
    for op in moved:
        op.repack()
    return len(moved)


class RepackAfterApply:
    """Bound as the fused model's ``__dict__["_apply"]`` by ``apply``: the class's ``_apply``, then ``repack``.

    Those ops read their projections' weights from one buffer without a copy (ops/qkv.py). ``model.to(dtype)``,
    ``.half()``, ``.cuda()`` give every Parameter a tensor of its own, after which each forward and backward
    concatenated the weights again: correct, and 1.055x the step time of a packed model (a bf16 attention +
    SwiGLU block, width 1024, 256 tokens, one CPU thread). The buffers are made again once the whole model is
    converted; a submodule converted alone keeps the copying fallback until ``repack(model)``. A module-level
    class holding the model, as the forward patches are, so the model pickles and deep-copies with it."""

    def __init__(self, host: nn.Module):
        self.host = host

    def __call__(self, fn, recurse: bool = True):
        out = type(self.host)._apply(self.host, fn, recurse)
        repack(self.host)
        return out


def repack_after_load(module: nn.Module, incompatible_keys) -> None:
    """A ``load_state_dict`` post hook of the fused model (``apply`` registers it where an op packs weights):
    ``load_state_dict(sd, assign=True)`` puts the checkpoint's own tensors in place, each on its own, after which
    the packing ops would copy them together at every call; ``repack`` puts them back into one buffer."""
    repack(module)
