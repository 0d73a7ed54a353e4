"""Save and resume a run across ranks through ``torch.distributed.checkpoint`` (DCP).

What is saved is what the next step reads: the fp32 masters and the optimizer moments (as DTensors
under FSDP2, so each rank writes only its shard and a resume may reshard), the step counters and the
loss scaler's state. The model's parameters are rewritten from the masters on load, and the dropout
step of a ``make_reproducible`` model is set to the resumed step, so a resumed run continues
bit-identically. Needs a ``MasterWeightOptimizer`` (``--precision fp16-master`` or ``bf16-master``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_step", "ResumeCallback"]

META = "opsnn_meta.json"


def _tensors(optimizer) -> dict:
    from opsnn_lab.parallel.optim import DistributedMasterWeightOptimizer

    if not hasattr(optimizer, "masters"):
        raise ValueError("checkpoints need a MasterWeightOptimizer (precision fp16-master or bf16-master)")
    sharded = isinstance(optimizer, DistributedMasterWeightOptimizer) and optimizer.sharded

    def wrap(t, p):
        if not sharded:
            return t
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    dparams = getattr(optimizer, "dparams", optimizer.params)
    out = {f"master.{n}": wrap(m, p) for n, m, p in zip(optimizer.names, optimizer.masters, dparams)}
    for k, moments in enumerate(optimizer.state):
        out.update({f"moment{k}.{n}": wrap(t, p) for n, t, p in zip(optimizer.names, moments, dparams)})
    return out


def save_checkpoint(path, optimizer, step: int) -> Path:
    """Write the optimizer's state at ``step`` (the next step to run) under ``path``; call on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    dcp.save(_tensors(optimizer), checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        scaler = optimizer.scaler.state_dict() if optimizer.scaler is not None else None
        (path / META).write_text(json.dumps({"step": step, "steps_taken": optimizer.steps_taken,
                                             "skipped_steps": optimizer.skipped_steps, "scaler": scaler}))
    if dist.is_initialized():
        dist.barrier()
    return path


def checkpoint_step(path) -> int:
    meta = Path(path) / META
    if not meta.exists():
        raise ValueError(f"resume: {str(path)!r} holds no opsnn_lab checkpoint ({META} is missing)")
    return int(json.loads(meta.read_text())["step"])


def load_checkpoint(path, optimizer, model=None) -> int:
    """Restore masters, moments, counters and scaler; rewrite the parameters; return the step to run next."""
    import torch.distributed.checkpoint as dcp

    step = checkpoint_step(path)
    meta = json.loads((Path(path) / META).read_text())
    state = _tensors(optimizer)
    dcp.load(state, checkpoint_id=str(path))
    with torch.no_grad():
        for n, m in zip(optimizer.names, optimizer.masters):
            src = state[f"master.{n}"]
            src = src.to_local() if hasattr(src, "to_local") else src
            if src.data_ptr() != m.data_ptr():
                m.copy_(src)
        for k, moments in enumerate(optimizer.state):
            for n, t in zip(optimizer.names, moments):
                src = state[f"moment{k}.{n}"]
                src = src.to_local() if hasattr(src, "to_local") else src
                if src.data_ptr() != t.data_ptr():
                    t.copy_(src)
        for p, m in zip(optimizer.params, optimizer.masters):
            p.copy_(m)
    optimizer.steps_taken = int(meta["steps_taken"])
    optimizer.skipped_steps = int(meta["skipped_steps"])
    if optimizer.scaler is not None and meta["scaler"] is not None:
        optimizer.scaler.load_state_dict(meta["scaler"])
    if model is not None:
        from opsnn_lab.consistency.seed_pool import set_step

        inner = getattr(model, "module", model)
        if getattr(inner, "_opsnn_reproducible", None) is not None:
            set_step(inner, step)
    return step


class ResumeCallback:
    """``ol.train`` callback: load ``path`` before the first step (the run's ``start_step`` must match)."""

    def __init__(self, path):
        self.path = path

    def on_train_start(self, model, optimizer):
        load_checkpoint(self.path, optimizer, model)

    def on_step_start(self, step, batch): ...
    def on_after_backward(self, step, model, loss): ...
    def on_step_end(self, step, model, loss): ...
    def on_train_end(self, result): ...
