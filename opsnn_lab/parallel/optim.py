"""``MasterWeightOptimizer`` across ranks: sharded fp32 masters under FSDP2, one skip decision for all ranks.

Under FSDP2 a parameter is a ``DTensor`` whose local shard is all this rank holds; the masters, moments
and the fused update then live on local shards only (the update is elementwise, so a shard's bits
equal the same slice of an unsharded update). Each rank scans only its gradients (its shard under FSDP),
so the scaler's findings -- found-inf, amax, flushed/total element counts -- are all-reduced before the
step is taken or skipped: a non-finite gradient on any one rank makes every rank skip, and every
rank's ``DynamicScaler`` moves the same way.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from opsnn_lab.precision.local_scaler import tensor_amaxes
from opsnn_lab.precision.master import MasterWeightOptimizer

__all__ = ["DistributedMasterWeightOptimizer", "is_dtensor", "local"]

_PAD = 64  # elements: whole AVX-512 double vectors (2 x 16 fp32), as strict()'s elementwise ops pad


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


class DistributedMasterWeightOptimizer(MasterWeightOptimizer):
    """``MasterWeightOptimizer`` whose step is agreed over ``group`` (default: the default group).

    Same arguments as ``MasterWeightOptimizer`` plus ``group``; ``pipelined=True`` is not supported
    (the skip decision needs every rank's scan before any update).
    """

    def __init__(self, params, *args, group=None, uniform_update: bool = False, **kwargs):
        if kwargs.get("pipelined"):
            raise ValueError("pipelined=True is not supported across ranks: the skip decision needs all ranks")
        super().__init__(params, *args, **kwargs)
        self.group = group
        self.uniform_update = bool(uniform_update)
        self.dparams = list(self.params)
        if any(is_dtensor(p) for p in self.dparams):
            with torch.no_grad():
                self.params = [local(p) for p in self.dparams]
                self.masters = [local(m) for m in self.masters]
                self.state = [[local(t) for t in s] for s in self.state]

    @property
    def sharded(self) -> bool:
        return any(is_dtensor(p) for p in self.dparams)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.dparams:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _grads(self, idx):
        keep, grads = [], []
        for i in idx:
            g = self.dparams[i].grad
            if g is None:
                continue
            g = local(g)
            keep.append(i)
            grads.append(g if self.grad_dtype is None or g.dtype == self.grad_dtype else g.to(self.grad_dtype))
        return keep, grads

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def _agree(self, found_inf: bool, amax: float, flushed: float, numel: int) -> tuple[bool, float, float, int]:
        """MAX of (found_inf, amax) and SUM of (flushed, numel) over the ranks (two small all-reduces)."""
        if self._world() == 1:
            return found_inf, amax, flushed, numel
        hi = torch.tensor([float(found_inf), amax if math.isfinite(amax) else 0.0], dtype=torch.float64)
        total = torch.tensor([flushed, float(numel)], dtype=torch.float64)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)  # integers below 2**53: exact
        inf = bool(hi[0] > 0)
        return inf, (math.inf if inf else float(hi[1])), float(total[0]), int(total[1])

    def _scaled_step(self, scaler) -> bool:
        idx, grads = self._grads(range(len(self.params)))
        names = [self.names[i] for i in idx]
        if scaler is not None:
            check = scaler.check(grads, names)  # this rank's scan, merged into the scaler's step check
            check.found_inf, check.amax, check.flushed, check.numel = self._agree(
                check.found_inf, check.amax, check.flushed, check.numel)
            skip = scaler._skip_this_step()
            self.last_nonfinite = list(check.nonfinite)
        else:
            live = [(n, g) for n, g in zip(names, grads) if g.numel()]
            per = tensor_amaxes([g for _, g in live]).tolist() if live else []
            self.last_nonfinite = [n for (n, _), a in zip(live, per) if not math.isfinite(a)]
            skip = self._agree(bool(self.last_nonfinite), 0.0, 0.0, 0)[0]
        if skip or not idx:
            self.skipped_steps += int(skip)
            return False
        self._apply(idx, grads, step=self.steps_taken + 1)
        self.steps_taken += 1
        return True

    def _apply(self, idx, grads, step):
        """``uniform_update``: one update over all local elements, zero padded to whole vector blocks.

        The CPU fused update runs a vectorised main loop and a scalar tail per tensor; the two can round
        differently (contracted multiply-adds), and which elements fall in the tail depends on the shard
        sizes, hence on the world size. Concatenated and padded to a multiple of ``_PAD`` elements, every
        element takes the vectorised path whatever the sharding (strict mode's bit-identity needs it).
        """
        if not self.uniform_update or not idx:
            return super()._apply(idx, grads, step)
        parts = [self.params[i].data for i in idx]
        sizes = [t.numel() for t in parts]
        pad = -sum(sizes) % _PAD

        def flat(ts):
            return torch.cat([t.reshape(-1) for t in ts] + [ts[0].new_zeros(pad)])

        p, w = flat(parts), flat([self.masters[i] for i in idx])
        states = [flat([s[i] for i in idx]) for s in self.state]
        g = flat(grads)
        saved = self.params, self.masters, self.state
        self.params, self.masters, self.state = [p], [w], [[t] for t in states]
        try:
            super()._apply([0], [g], step)
        finally:
            self.params, self.masters, self.state = saved
        with torch.no_grad():
            for dst, src in ((parts, p), ([self.masters[i] for i in idx], w),
                             *(([s[i] for i in idx], t) for s, t in zip(self.state, states))):
                for d, chunk in zip(dst, src[:sum(sizes)].split(sizes)):
                    d.copy_(chunk.view_as(d))

    def full_masters(self) -> list[torch.Tensor]:
        """Every master as a full fp32 tensor (an all-gather per sharded parameter; call on every rank)."""
        if not self.sharded:
            return [m.detach() for m in self.masters]
        from torch.distributed.tensor import DTensor

        out = []
        for p, m in zip(self.dparams, self.masters):
            d = DTensor.from_local(m, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            out.append(d.full_tensor())
        return out
