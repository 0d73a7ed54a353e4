"""Sums over blocks and ranks in one fixed pairwise order, so the bits do not depend on the world size.

A balanced pairwise tree over ``2**k`` leaves splits into subtrees at every power-of-two boundary:
summing each rank's blocks pairwise and then the ranks' results pairwise (in rank order) is the same
tree as summing all blocks pairwise on one rank. That is what makes a weight gradient bit-identical
for 1, 2 and 4 ranks sharing a global batch of fixed-size row blocks. Backends do not promise an
all-reduce order (ring, tree and halving-doubling give different bits), so the cross-rank sum here
is an all-gather (or all-to-all, for a reduce-scatter) followed by the ordered pairwise sum.
Elementwise ``a + b`` is deterministic on every device, so the tree alone fixes the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

try:  # the interface FSDP2's set_custom_reduce_scatter expects (not re-exported by torch.distributed.fsdp)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - older torch: any callable with allocate() works
    ReduceScatter = object

__all__ = ["pairwise_sum", "PairwiseAccumulator", "ordered_all_reduce", "OrderedReduceScatter"]


def _add(a, b):
    if isinstance(a, (list, tuple)):
        return [_add(x, y) for x, y in zip(a, b)]
    return a + b


def pairwise_sum(values: Sequence):
    """Sum ``values`` (tensors, or equal-length lists of tensors) as a balanced pairwise tree, in order.

    ``((v0 + v1) + (v2 + v3)) + ...``; an odd element at a level is carried up unchanged.
    """
    items = list(values)
    if not items:
        raise ValueError("values must not be empty")
    while len(items) > 1:
        nxt = [_add(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0]


class PairwiseAccumulator:
    """``pairwise_sum`` fed one value at a time, holding at most log2(n) partial sums (a binary counter).

    For a power-of-two count of values the result equals ``pairwise_sum(values)`` bit for bit.
    """

    def __init__(self):
        self._stack: list[tuple[int, object]] = []
        self.count = 0

    def add(self, value) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, prev = self._stack.pop()
            value = _add(prev, value)
            level += 1
        self._stack.append((level, value))
        self.count += 1

    def result(self):
        if not self._stack:
            raise ValueError("nothing was added")
        if len(self._stack) > 1:  # not a power of two: fold what is left, oldest (largest) first
            return pairwise_sum([v for _, v in self._stack])
        return self._stack[0][1]


def ordered_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum of ``tensor`` over the ranks of ``group``: all-gather, then a pairwise sum in rank order.

    Costs ``world_size`` times the bytes of a ring all-reduce's receive side; meant for the strict mode
    (and small tensors such as a loss or a found-inf flag), where the order matters more than the bytes.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return tensor
    world = dist.get_world_size(group)
    src = tensor.contiguous()
    gathered = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(gathered, src, group=group)
    tensor.copy_(pairwise_sum(gathered))
    return tensor


class OrderedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter that keeps every (rank, block) contribution and sums them in a fixed tree.

    Set on each FSDP module with ``set_custom_reduce_scatter``. Each backward of one row block calls it
    once: an all-to-all hands this rank every rank's slice of its shard, which is kept. On the last
    block (``final = True``) the shard's gradient is the pairwise sum over each rank's blocks, then over
    ranks in rank order -- the tree ``pairwise_sum`` forms over all blocks of the global batch on one
    rank. Earlier blocks write zeros (the caller drops those grads). Needs SUM reduction and a divide
    factor of 1 (the loss is already normalised by the global batch).
    """

    def __init__(self):
        self.final = False
        self._blocks: list[torch.Tensor] = []
        self.bytes_sent = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world = group.size()
        recv = torch.empty_like(input_tensor)
        dist.all_to_all_single(recv, input_tensor.contiguous(), group=group)
        self.bytes_sent += input_tensor.numel() * input_tensor.element_size() * (world - 1) // world
        self._blocks.append(recv.view(world, -1))
        if not self.final:
            output_tensor.zero_()
            return None
        blocks, self._blocks = self._blocks, []
        per_rank = [pairwise_sum([b[r] for b in blocks]) for r in range(world)]
        output_tensor.copy_(pairwise_sum(per_rank))
        return None
