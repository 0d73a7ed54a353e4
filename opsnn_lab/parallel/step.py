"""One optimizer step's forward and backward across ranks, with the loss normalised by the global batch.

Every rank builds the whole global batch (``task.batch(step)``, cheap and identical everywhere) and
keeps its rows ``[rank * B/W, (rank + 1) * B/W)``. A row's weight in the loss is its number of targets
(masked tokens, or 1 per image) over the global batch's: a rank's mean loss is multiplied by its share,
so the gradient is that of the global mean whatever the world size (DDP and FSDP then average over W,
so the share is multiplied by W; the strict path sums instead of averaging).

Strict mode (``strict=True``): the local rows are cut into blocks of ``block_rows``; each block runs
its own forward and backward (the same computation, bit for bit, whichever rank runs it), and the
blocks' weight gradients are summed pairwise -- per rank, then across ranks in rank order -- by
:mod:`opsnn_lab.parallel.ordered_reduce`. With power-of-two world sizes and block counts that is one
tree over the global batch, so 1, 2 and 4 ranks end with the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from opsnn_lab.parallel.ordered_reduce import PairwiseAccumulator, ordered_all_reduce

__all__ = ["row_weights", "slice_rows", "make_forward_backward"]


def row_weights(batch: dict) -> torch.Tensor:
    """Targets per row: labels != -100 for token labels (B, T), else 1 per row."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if isinstance(labels, torch.Tensor) and labels.dim() > 1:
        return (labels != -100).flatten(1).sum(1)
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    return torch.ones(rows, dtype=torch.long)


def slice_rows(batch: dict, start: int, stop: int) -> dict:
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    return {k: v[start:stop] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
            for k, v in batch.items()}


def _global_loss(value: torch.Tensor, world: int, ordered: bool) -> torch.Tensor:
    """The global batch's loss from each rank's share (a pairwise sum in rank order when ``ordered``)."""
    if world == 1:
        return value
    t = value.detach().float().reshape(1).clone()
    if ordered:
        ordered_all_reduce(t)
    else:
        dist.all_reduce(t)
    return t[0]


def make_forward_backward(task, ctx, *, parallel: str, scaler=None, autocast=contextlib.nullcontext,
                          strict: bool = False, block_rows: int | None = None, comms=(), grad_hook=None
                          ) -> Callable:
    """``forward_backward(model, batch) -> loss`` for ``ol.train``'s loop (``batch``: the global batch).

    ``comms``: the FSDP modules' :class:`OrderedReduceScatter` s (strict FSDP). ``grad_hook(model)`` runs
    after the gradients are final (tests inject overflows with it).
    """
    rank, world = ctx.rank, ctx.world_size

    def local_rows(batch):
        weights = row_weights(batch)
        rows = weights.shape[0]
        if rows % world:
            raise ValueError(f"the global batch of {rows} rows does not split over {world} ranks; "
                             "pick a global batch size that world_size divides")
        per = rows // world
        return slice_rows(batch, rank * per, (rank + 1) * per), weights[rank * per:(rank + 1) * per], \
            float(weights.sum())

    def scaled(loss):
        return scaler.scale_loss(loss) if scaler is not None else loss

    def plain(model, batch):
        mine, w, total = local_rows(batch)
        with autocast():
            loss = task.loss(model, mine) * (float(w.sum()) / total)
        scaled(loss * world).backward()  # DDP/FSDP average over ranks: undo it, the share already holds 1/W
        if grad_hook is not None:
            grad_hook(model)
        return _global_loss(loss, world, ordered=False)

    def blocked(model, batch):
        mine, w, total = local_rows(batch)
        per = w.shape[0]
        b = block_rows or per
        if per % b or (per // b) & (per // b - 1):
            raise ValueError(f"block_rows={b} must split each rank's {per} rows into a power-of-two number of "
                             "blocks (strict mode sums blocks as a pairwise tree)")
        n = per // b
        params = [p for p in model.parameters() if p.requires_grad]
        acc, losses = PairwiseAccumulator(), PairwiseAccumulator()
        sync = contextlib.nullcontext
        if parallel == "ddp" and world > 1:
            sync = model.no_sync
        for j in range(n):
            last = j == n - 1
            for comm in comms:
                comm.final = last
            block = slice_rows(mine, j * b, (j + 1) * b)
            with sync():  # DDP reads the sync flag in forward and in backward
                with autocast():
                    loss = task.loss(model, block) * (float(w[j * b:(j + 1) * b].sum()) / total)
                scaled(loss).backward()
            losses.add(loss.detach().float())
            if comms and world > 1:  # FSDP: the reduce-scatter kept this block; only the last block's grad counts
                if not last:
                    for p in params:
                        p.grad = None
                continue
            acc.add([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
            for p in params:
                p.grad = None
        if not (comms and world > 1):
            grads = acc.result()
            if parallel == "ddp" and world > 1:
                flat = torch.cat([g.reshape(-1) for g in grads])
                ordered_all_reduce(flat)
                grads = list(flat.split([g.numel() for g in grads]))
                grads = [g.view_as(p) for g, p in zip(grads, params)]
            for p, g in zip(params, grads):
                p.grad = g
        if grad_hook is not None:
            grad_hook(model)
        return _global_loss(losses.result(), world, ordered=True)

    return blocked if strict else plain

