"""fp16 gradient all-reduce for DistributedDataParallel, with one shared power-of-two scale.

The seed's stage 2 ("NCCL all-reduce in FP16 for speed, FP32 master copy for the update"). The stock
``fp16_compress_hook`` casts each rank's bucket to fp16 as is, so gradients below 6e-8 flush to zero
and a sum above 65504 overflows. This hook first all-reduces the bucket's amax (MAX, 8 bytes with a NaN/Inf flag), picks
``scale = 2**ceil(log2(amax * world_size / FP16_MAX))`` (identical on every rank, with log2(world_size)
of headroom so the fp16 sum cannot overflow), sends ``bucket / scale`` in fp16 (half the bytes of fp32)
and unscales the sum into fp32 before averaging. A non-finite amax on any rank gives every rank a
non-finite bucket, so every rank's scaler skips the same step.

Under a loss scaler (``Fp16AllReduceState(scaler=...)``, what ``--precision fp16-master`` registers) the
gradients already carry the scaler's loss scale, and that scale is the same on every rank (the
optimizer all-reduces found-inf, so every rank's ``DynamicScaler`` moves alike). The hook then needs no
exchange at all: it divides by the power of two ``2**ceil(log2(world_size))`` (the same headroom, so the
fp16 sum cannot overflow), sends fp16 and unscales. A value too large for fp16 becomes inf in the cast
and inf/NaN survive the sum, so every rank receives a non-finite bucket and skips the same step; the
scaler backs off. Bytes on the wire: exactly half of fp32.

A runnable 2-rank comparison with the stock hook is ``opsnn_lab.demos.precision.allreduce_demo``.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from opsnn_lab.precision.local_scaler import FP16_MAX, _mul_pow2, pow2_scale, tensor_amaxes

__all__ = ["fp16_allreduce_hook", "Fp16AllReduceState"]


@dataclass
class Fp16AllReduceState:
    """Optional hook state: the process group and counters of what went over the wire."""

    group: object = None  # a ProcessGroup, or None for the default group
    scaler: object = None  # the loss scaler the gradients carry (e.g. DynamicScaler): no amax exchange
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
    if isinstance(state, Fp16AllReduceState) and state.scaler is not None:
        k = -(world - 1).bit_length()  # 2**-ceil(log2(world)): the sum of world values stays finite
        return _send_fp16(state, group, world, buf, k)
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
    return _send_fp16(state, group, world, buf, -int(math.log2(pow2_scale(amax_f, FP16_MAX, world))))


def _send_fp16(state, group, world: int, buf: torch.Tensor, k: int) -> torch.futures.Future[torch.Tensor]:
    """All-reduce ``buf * 2**k`` in fp16, then write the exact unscaled average back into ``buf``."""
    low = _mul_pow2(buf, k).to(torch.float16)
    if isinstance(state, Fp16AllReduceState):
        state.record(buf.numel(), math.ldexp(1.0, -k))
    work = dist.all_reduce(low, group=group, async_op=True)

    def finish(fut):
        summed = fut.value()[0]
        buf.copy_(_mul_pow2(summed.float(), -k).div_(world))  # exact unscale, then the average
        return buf

    return work.get_future().then(finish)
