"""Pairwise sums: the tree over all blocks equals per-rank subtrees summed in rank order, bit for bit."""

from __future__ import annotations

import pytest
import torch

from opsnn_lab.parallel.ordered_reduce import PairwiseAccumulator, pairwise_sum


def _blocks(n, shape=(37, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    # wide magnitudes make the order of the additions visible in the bits
    return [torch.randn(shape, generator=g) * 10.0 ** torch.randint(-6, 6, (1,), generator=g).item() for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_subtrees_in_rank_order_equal_the_global_tree(world):
    blocks = _blocks(16)
    per = len(blocks) // world
    per_rank = [pairwise_sum(blocks[r * per:(r + 1) * per]) for r in range(world)]
    assert torch.equal(pairwise_sum(per_rank), pairwise_sum(blocks))


def test_the_order_matters_so_the_test_above_can_fail():
    blocks = _blocks(16)
    left = blocks[0]
    for b in blocks[1:]:
        left = left + b
    assert not torch.equal(left, pairwise_sum(blocks))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 3, 5])
def test_accumulator_equals_pairwise_sum(n):
    blocks = _blocks(n, seed=n)
    acc = PairwiseAccumulator()
    for b in blocks:
        acc.add([b, b * 2])
    got = acc.result()
    if n & (n - 1) == 0:
        assert torch.equal(got[0], pairwise_sum(blocks))
        assert torch.equal(got[1], pairwise_sum([b * 2 for b in blocks]))
    else:
        torch.testing.assert_close(got[0], torch.stack(blocks).double().sum(0).float(), rtol=1e-5, atol=1e-3)
    assert acc.count == n


def test_empty_inputs_are_rejected():
    with pytest.raises(ValueError, match="values"):
        pairwise_sum([])
    with pytest.raises(ValueError, match="nothing"):
        PairwiseAccumulator().result()
