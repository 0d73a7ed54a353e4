"""The mixed-precision pillar, runnable: the pieces notebook 02 and the tests call.

* ``train_scaled``: ``ol.train``'s loop for a scaled loss, with a ``DynamicScaler`` +
  ``MasterWeightOptimizer`` or a ``torch.amp.GradScaler`` + torch optimizer, gradients optionally
  routed through fp16 (what an fp16 gradient pipeline does to them: overflow to Inf, flush to zero).
* ``flat_weights`` / ``update_cosine``: the seed's "direction bias", the cosine between an update and
  the fp32 baseline's update from the same start.
* ``allreduce_demo`` / ``allreduce_errors``: 2 gloo ranks on 127.0.0.1 all-reduce gradients of chosen
  magnitudes with plain fp32, ``torch``'s ``fp16_compress_hook`` and ``fp16_allreduce_hook``. Worker
  functions live here because the spawn start method imports them by name (a notebook cell's function
  cannot be pickled).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from opsnn_lab._checks import check_positive, check_type
from opsnn_lab.parallel.runtime import destroy_process_group, free_port
from opsnn_lab.precision import Fp16AllReduceState, fp16_allreduce_hook
from opsnn_lab.training import Callback, TrainResult

__all__ = ["train_scaled", "RoundWeights", "flat_weights", "update_cosine", "allreduce_demo", "allreduce_errors"]


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

def _rank_grad(rank: int, magnitude: float, numel: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s gradient; magnitude NaN means: scale 1, and rank 1 alone holds one NaN."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if math.isnan(magnitude):
        out = torch.randn(numel, generator=g)
        if rank == 1:
            out[0] = math.nan
        return out
    return torch.randn(numel, generator=g) * magnitude


class _Vector(torch.nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()  # d/dw = c: each rank's gradient is exactly what it was handed


def _reduce_once(name: str, rank: int, mag: float, numel: int, seed: int):
    """One DDP backward with hook ``name``: (rank's averaged gradient, the opsnn hook's state)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_Vector(numel))
    state = Fp16AllReduceState()
    if name == "stock_fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif name == "opsnn_fp16":
        ddp.register_comm_hook(state, fp16_allreduce_hook)
    ddp(_rank_grad(rank, mag, numel, seed)).backward()
    return ddp.module.w.grad.clone(), state  # the DDP model goes here, before its process group does


def _demo_worker(rank: int, world: int, port: int, magnitudes, numel: int, seed: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for mag in magnitudes:
            for name in ("fp32", "stock_fp16", "opsnn_fp16"):
                results[(repr(mag), name)], state = _reduce_once(name, rank, mag, numel, seed)
                if name == "opsnn_fp16":
                    results[(repr(mag), "bytes")] = (state.bytes_reduced, state.bytes_fp32, state.scales)
        torch.save(results, f"{out}.{rank}")
    finally:
        destroy_process_group()


def _both_all_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.isnan(a).all() and torch.isnan(b).all())


def allreduce_demo(magnitudes: Sequence[float] = (1e-9, 1.0, 1e5), numel: int = 1024, world_size: int = 2,
                   seed: int = 0) -> dict:
    """Spawn ``world_size`` gloo ranks on 127.0.0.1 and all-reduce gradients of each magnitude three ways.

    Returns ``{magnitude: {"fp32", "stock_fp16", "opsnn_fp16", "exact"}}`` of rank 0's averaged gradients
    (``exact``: the fp64 mean), ``"bytes"``: (fp16 payload bytes, fp32 bytes, scales) of the opsnn hook and
    ``"ranks_agree"``: every rank got the same opsnn result. A magnitude of ``nan`` gives rank 1 one NaN.
    """
    check_positive("numel", numel, integer=True)
    check_positive("world_size", world_size, integer=True)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.pt")
        for attempt in range(2):  # a free port can be taken by another process before gloo binds it: retry once
            try:
                mp.spawn(_demo_worker, args=(world_size, free_port(), tuple(magnitudes), numel, seed, out),
                         nprocs=world_size, join=True)
                break
            except mp.ProcessExitedException:
                if attempt:
                    raise
        ranks = [torch.load(f"{out}.{r}") for r in range(world_size)]
    raw, report = ranks[0], {}
    for mag in magnitudes:
        exact = torch.stack([_rank_grad(r, mag, numel, seed).double() for r in range(world_size)]).mean(0)
        key = repr(mag)  # nan != nan: key the saved results by text
        report[mag] = {k: raw[(key, k)] for k in ("fp32", "stock_fp16", "opsnn_fp16", "bytes")}
        report[mag]["exact"] = exact
        report[mag]["ranks_agree"] = all(torch.equal(raw[(key, "opsnn_fp16")], other[(key, "opsnn_fp16")],
                                                     ) or _both_all_nan(raw[(key, "opsnn_fp16")],
                                                                        other[(key, "opsnn_fp16")])
                                         for other in ranks[1:])
    return report


# how notebook 02 names the three ways in its table
HOOK_LABELS = {"fp32": "fp32", "stock_fp16": "torch fp16_compress_hook", "opsnn_fp16": "fp16_allreduce_hook"}


def allreduce_errors(report: dict) -> dict[str, dict[float, float]]:
    """``{hook label: {magnitude: max |got - exact| / max |exact|}}`` from an ``allreduce_demo`` report.

    A non-finite error (an overflowed or NaN result) reads ``inf``; 1.0 means everything flushed to zero.
    """
    check_type("report", report, dict)
    out: dict[str, dict[float, float]] = {label: {} for label in HOOK_LABELS.values()}
    for mag, r in report.items():
        exact = r["exact"]
        for key, label in HOOK_LABELS.items():
            err = (r[key].double() - exact).abs().max() / exact.abs().max()
            out[label][mag] = float(err) if torch.isfinite(err) else math.inf
    return out
