"""The state a run ends with: full fp32 master weights in one canonical order, their hash, and comparisons.

Canonical order: the parameters of the unwrapped model in ``named_parameters()`` order, names without
wrapper prefixes (``module.`` of DDP). Each entry hashes its name, shape and little-endian fp32 bytes,
so two runs agree on ``state.sha256`` exactly when every master weight has the same bits.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

__all__ = ["master_weights", "state_sha256", "max_relative_difference"]


def _plain_names(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [n[len("module."):] if n.startswith("module.") else n for n in names]


def master_weights(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """``{name: full fp32 master}`` on every rank (under FSDP each shard is all-gathered: call on all ranks).

    ``optimizer``: a ``MasterWeightOptimizer`` (its masters) or any optimizer (the parameters are the masters).
    """
    from opsnn_lab.parallel.optim import DistributedMasterWeightOptimizer, is_dtensor

    names = _plain_names(model)
    if isinstance(optimizer, DistributedMasterWeightOptimizer):
        tensors = optimizer.full_masters()
    elif hasattr(optimizer, "masters"):
        tensors = [m.detach() for m in optimizer.masters]
    else:
        tensors = [p.detach() for p in model.parameters() if p.requires_grad]
        tensors = [t.full_tensor() if is_dtensor(t) else t for t in tensors]
    if len(tensors) != len(names):
        raise ValueError(f"optimizer holds {len(tensors)} masters for {len(names)} trainable parameters")
    return {n: t.float().cpu().contiguous() for n, t in zip(names, tensors)}


def state_sha256(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in weights.items():
        h.update(f"{name}:{tuple(t.shape)}:".encode())
        h.update(t.float().contiguous().numpy().astype("<f4").tobytes())
    return h.hexdigest()


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over parameters of ``max|a - b| / max|a|`` (0.0 when bit-identical)."""
    if a.keys() != b.keys():
        raise ValueError("the two states hold different parameters")
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        scale = float(x.abs().max()) if x.numel() else 0.0
        diff = float((x - y).abs().max()) if x.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst
