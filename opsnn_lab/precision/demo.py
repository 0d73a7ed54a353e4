"""Small runnable pieces of the mixed-precision story, shared by notebook 02 and the benchmarks.

* ``train_scaled``: ``ol.train``'s loop for a scaled loss, with a ``DynamicScaler`` +
  ``MasterWeightOptimizer`` or a ``torch.amp.GradScaler`` + torch optimizer, gradients optionally
  routed through fp16 (what an fp16 gradient pipeline does to them: overflow to Inf, flush to zero).
* ``flat_weights`` / ``update_cosine``: the seed's "direction bias", the cosine between an update and
  the fp32 baseline's update from the same start.
* ``allreduce_demo``: 2 gloo ranks on 127.0.0.1 all-reduce gradients of chosen magnitudes with plain
  fp32, ``torch``'s ``fp16_compress_hook`` and ``fp16_allreduce_hook``. Worker functions live here
  because the spawn start method imports them by name (a notebook cell's function cannot be pickled).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from opsnn_lab._checks import check_positive, check_type
from opsnn_lab.training import Callback, TrainResult

__all__ = ["train_scaled", "RoundWeights", "flat_weights", "update_cosine", "allreduce_demo"]


def _scale_of(scaler) -> float:
    return float(scaler.get_scale()) if hasattr(scaler, "get_scale") else float(scaler.scale)


def train_scaled(model: nn.Module, task, steps: int, *, optimizer, scaler, grad_dtype: torch.dtype | None = None,
                 callbacks: Sequence[Callback] = (), progress: bool | None = None, desc: str = "scaled") -> TrainResult:
    """Train with a scaled loss; returns a ``TrainResult`` whose ``extras`` hold ``scale`` and ``skipped``.

    ``scaler`` is a ``DynamicScaler`` (``optimizer`` a ``MasterWeightOptimizer`` built with it, whose
    ``step()`` updates the scale) or a ``torch.amp.GradScaler`` (``optimizer`` a torch optimizer).
    ``grad_dtype`` rounds every ``.grad`` through that dtype after backward (GradScaler path; the
    ``MasterWeightOptimizer`` does it itself with its own ``grad_dtype``). Callbacks see the scaled grads.
    """
    check_type("model", model, nn.Module)
    check_positive("steps", steps, allow_zero=True, integer=True)
    is_torch = isinstance(scaler, torch.amp.GradScaler)
    if not is_torch and not hasattr(scaler, "scale_loss"):
        raise TypeError(f"scaler must be a DynamicScaler or a torch.amp.GradScaler, got {type(scaler).__name__}")
    from tqdm.auto import tqdm

    result = TrainResult(extras={"scale": [], "skipped": []})
    model.train()
    for cb in callbacks:
        cb.on_train_start(model, optimizer)
    t0 = time.perf_counter()
    for step in tqdm(range(steps), desc=desc, leave=False, mininterval=0.5,
                     disable=(not progress) if progress is not None else steps < 20):
        batch = task.batch(step)
        for cb in callbacks:
            cb.on_step_start(step, batch)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        used = _scale_of(scaler)
        (scaler.scale(loss) if is_torch else scaler.scale_loss(loss)).backward()
        if grad_dtype is not None:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.copy_(p.grad.to(grad_dtype))
        for cb in callbacks:
            cb.on_after_backward(step, model, loss)
        if is_torch:
            scaler.step(optimizer)
            scaler.update()
            skipped = _scale_of(scaler) < used  # GradScaler backs off exactly on the steps it skipped
        else:
            skipped = not optimizer.step()
        value = float(loss.detach())
        result.losses.append(value)
        result.extras["scale"].append(used)
        result.extras["skipped"].append(bool(skipped))
        for cb in callbacks:
            cb.on_step_end(step, model, value)
    result.seconds = time.perf_counter() - t0
    for cb in callbacks:
        cb.on_train_end(result)
    return result


class RoundWeights(Callback):
    """After every optimizer step, round the weights to ``dtype`` and back: a model whose weights are
    STORED in fp16/bf16 and updated in place (the naive low-precision update), computing in fp32."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype

    def on_train_start(self, model: nn.Module, optimizer) -> None:
        self._round(model)

    def on_step_end(self, step: int, model: nn.Module, loss: float) -> None:
        self._round(model)

    def _round(self, model: nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(self.dtype))


def flat_weights(params: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
    """All weights as one fp32 vector (a copy), in ``named_parameters`` order for a module."""
    tensors = [p for _, p in params.named_parameters()] if isinstance(params, nn.Module) else list(params)
    if not tensors:
        raise ValueError("params holds no tensors")
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def update_cosine(before: torch.Tensor, after: torch.Tensor, ref_before: torch.Tensor,
                  ref_after: torch.Tensor) -> float:
    """Cosine between the update ``after - before`` and the reference update (1.0: same direction)."""
    for name, t in (("before", before), ("after", after), ("ref_before", ref_before), ("ref_after", ref_after)):
        check_type(name, t, torch.Tensor)
    if not before.shape == after.shape == ref_before.shape == ref_after.shape:
        raise ValueError("before, after, ref_before and ref_after must have one shape")
    d, r = (after.double() - before.double()), (ref_after.double() - ref_before.double())
    denom = d.norm() * r.norm()
    return float((d @ r) / denom) if denom > 0 else math.nan


# ---------------------------------------------------------------- 2-rank all-reduce demo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_grads(rank: int, magnitude: float, numel: int) -> torch.Tensor:
    """Rank ``rank``'s gradient: magnitudes in [0.5, 1.5] * magnitude, random signs (fp64)."""
    g = torch.Generator().manual_seed(1000 * rank + 7)
    signs = torch.where(torch.rand(numel, generator=g) < 0.5, -1.0, 1.0).double()
    return (torch.rand(numel, generator=g, dtype=torch.float64) + 0.5) * magnitude * signs


def _hooks() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from opsnn_lab.precision import fp16_allreduce_hook

    return {"fp32": None, "torch fp16_compress_hook": default_hooks.fp16_compress_hook,
            "fp16_allreduce_hook": fp16_allreduce_hook}


def _allreduce_worker(rank: int, world_size: int, port: int, magnitudes: Sequence[float], numel: int, queue) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = {}
        for mag in magnitudes:
            exact = sum(_rank_grads(r, mag, numel) for r in range(world_size)) / world_size
            x = _rank_grads(rank, mag, numel).float()
            for name, hook in _hooks().items():
                model = nn.Linear(numel, 1, bias=False)
                ddp = DDP(model)
                if hook is not None:
                    ddp.register_comm_hook(None if name == "fp16_allreduce_hook" else dist.group.WORLD, hook)
                ddp(x[None]).sum().backward()  # d/dw of w . x is x: the gradient is this rank's x
                got = model.weight.grad.reshape(-1).double()
                err = (got - exact).abs().max() / exact.abs().max()
                out[(name, mag)] = float(err) if torch.isfinite(err) else math.inf
                del ddp
        if rank == 0:
            queue.put(out)
        dist.barrier()  # no rank tears down its gloo pairs while a peer still uses them
    finally:
        dist.destroy_process_group()


def allreduce_demo(magnitudes: Sequence[float] = (1e-9, 1.0, 1e5), world_size: int = 2,
                   numel: int = 4096) -> dict[str, dict[float, float]]:
    """Relative max error of the averaged gradient vs the exact fp64 mean, per hook and magnitude.

    Spawns ``world_size`` gloo ranks on 127.0.0.1 (torch.multiprocessing, spawn). Each rank's gradient
    has elements of magnitude 0.5x..1.5x ``magnitude``; 1e-9 is below fp16's smallest subnormal and
    1.5e5 / 2 ranks is above fp16's max, which is where a plain fp16 cast fails.
    """
    import torch.multiprocessing as mp

    check_positive("world_size", world_size, integer=True)
    check_positive("numel", numel, integer=True)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    for attempt in range(2):  # a free port can be taken by another process before gloo binds it: retry once
        try:
            mp.spawn(_allreduce_worker, args=(world_size, _free_port(), list(magnitudes), numel, queue),
                     nprocs=world_size, join=True)
            break
        except mp.ProcessExitedException:
            if attempt:
                raise
    flat = queue.get()
    out: dict[str, dict[float, float]] = {}
    for (name, mag), err in flat.items():
        out.setdefault(name, {})[mag] = err
    return out
