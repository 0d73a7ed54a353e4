"""fp16 gradient all-reduce for DistributedDataParallel, with one shared power-of-two scale.

The seed's stage 2 ("NCCL all-reduce in FP16 for speed, FP32 master copy for the update"). The stock
``fp16_compress_hook`` casts each rank's bucket to fp16 as is, so gradients below 6e-8 flush to zero
and a sum above 65504 overflows. This hook first all-reduces the bucket's amax (MAX, 8 bytes with a NaN/Inf flag), picks
``scale = 2**ceil(log2(amax * world_size / FP16_MAX))`` (identical on every rank, with log2(world_size)
of headroom so the fp16 sum cannot overflow), sends ``bucket / scale`` in fp16 (half the bytes of fp32)
and unscales the sum into fp32 before averaging. A non-finite amax on any rank gives every rank a
non-finite bucket, so every rank's scaler skips the same step.
"""

import math
import os
import socket
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from opsnn_lab._checks import check_positive
from opsnn_lab.precision.local_scaler import FP16_MAX, _mul_pow2, pow2_scale, tensor_amaxes

__all__ = ["fp16_allreduce_hook", "Fp16AllReduceState", "allreduce_demo"]


@dataclass
class Fp16AllReduceState:
    """Optional hook state: the process group and counters of what went over the wire."""

    group: object = None  # a ProcessGroup, or None for the default group
    calls: int = 0
    bytes_reduced: int = 0  # payload of the fp16 all-reduces
    bytes_fp32: int = 0  # what the same buckets would have cost in fp32
    scales: list[float] = field(default_factory=list)  # last 1000 scales chosen

    def record(self, numel: int, scale: float) -> None:
        self.calls += 1
        self.bytes_reduced += 2 * numel
        self.bytes_fp32 += 4 * numel
        self.scales = (self.scales + [scale])[-1000:]


def fp16_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp.register_comm_hook(None, fp16_allreduce_hook)`` (``None``: the default group).

    (No ``from __future__ import annotations`` in this file: DDP checks the return annotation object.)

    ``state`` may also be a ProcessGroup or a :class:`Fp16AllReduceState`. Returns a Future of the
    bucket's fp32 tensor holding the average over ranks.
    """
    group = state.group if isinstance(state, Fp16AllReduceState) else state
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    local = tensor_amaxes([buf])[0] if buf.numel() else torch.zeros((), device=buf.device)
    # [amax, fault] with fault 2 = NaN, 1 = Inf: a MAX over NaN is backend-defined (gloo drops it), a flag is not
    fault = torch.where(torch.isnan(local), 2.0, torch.where(torch.isinf(local), 1.0, 0.0))
    stats = torch.stack([torch.where(fault > 0, 0.0, local), fault])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)  # 8 bytes: tiny next to the bucket
    amax_f, fault_f = stats.tolist()
    if fault_f:
        buf.fill_(math.nan if fault_f == 2.0 else math.inf)  # every rank gets it and skips the same step
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut
    scale = pow2_scale(amax_f, FP16_MAX, world)
    k = int(math.log2(scale))
    low = _mul_pow2(buf, -k).to(torch.float16)
    if isinstance(state, Fp16AllReduceState):
        state.record(buf.numel(), scale)
    work = dist.all_reduce(low, group=group, async_op=True)

    def finish(fut):
        summed = fut.value()[0]
        buf.copy_(_mul_pow2(summed.float(), k).div_(world))  # exact unscale, then the average
        return buf

    return work.get_future().then(finish)


# ------------------------------------------------------------------------------------------ 2-rank demo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _demo_worker(rank: int, world: int, port: int, magnitudes, numel: int, seed: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for mag in magnitudes:
            for name in ("fp32", "stock_fp16", "opsnn_fp16"):
                ddp = DDP(_Vector(numel))
                state = Fp16AllReduceState()
                if name == "stock_fp16":
                    ddp.register_comm_hook(None, fp16_compress_hook)
                elif name == "opsnn_fp16":
                    ddp.register_comm_hook(state, fp16_allreduce_hook)
                ddp(_rank_grad(rank, mag, numel, seed)).backward()
                results[(repr(mag), name)] = ddp.module.w.grad.clone()
                if name == "opsnn_fp16":
                    results[(repr(mag), "bytes")] = (state.bytes_reduced, state.bytes_fp32, state.scales)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _both_all_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.isnan(a).all() and torch.isnan(b).all())


def allreduce_demo(magnitudes=(1e-9, 1e5), numel: int = 1024, world_size: int = 2, seed: int = 0) -> dict:
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
        mp.spawn(_demo_worker, args=(world_size, _free_port(), tuple(magnitudes), numel, seed, out),
                 nprocs=world_size, join=True)
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
