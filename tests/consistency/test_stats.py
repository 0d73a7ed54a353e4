"""Per-tensor statistics and the bitwise hash."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.consistency.stats import TensorStats, stats_from_dict, summarize, tensor_hash
from opsnn_lab.testing import non_contiguous, seeded


def test_summary_statistics_match_torch():
    x = seeded(7, 9, scale=3.0)
    s = summarize(x)
    assert s.shape == (7, 9) and s.dtype == "float32"
    assert (s.min, s.max) == (x.min().item(), x.max().item())
    assert s.mean == pytest.approx(x.double().mean().item(), abs=1e-6)
    assert s.std == pytest.approx(x.double().std().item(), rel=1e-5)
    assert s.norm == pytest.approx(x.double().norm().item(), rel=1e-6)
    assert s.nan == s.inf == 0
    y = x.clone()
    y[0, 0], y[1, 1], y[2, 2] = math.nan, math.inf, -math.inf
    s = summarize(y)
    assert (s.nan, s.inf) == (1, 2)
    finite = y[torch.isfinite(y)]
    assert (s.min, s.max) == (finite.min().item(), finite.max().item())
    assert s.mean == pytest.approx(finite.double().mean().item(), abs=1e-6)
    empty = summarize(torch.zeros(0, 3))
    assert empty.shape == (0, 3) and empty.norm == 0.0
    ints = summarize(torch.arange(5))
    assert (ints.min, ints.max, ints.mean) == (0.0, 4.0, 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_hash_sees_one_ulp_and_a_permutation_but_not_the_layout(dtype):
    x = seeded(33, 17, dtype=dtype)
    h = tensor_hash(x)
    assert tensor_hash(x.clone()) == h
    assert tensor_hash(non_contiguous(x)) == h
    y = x.clone()
    y[5, 3] = torch.nextafter(y[5, 3], torch.tensor(math.inf, dtype=dtype))
    assert tensor_hash(y) != h
    assert tensor_hash(x.flip(0)) != h
    assert tensor_hash(torch.tensor([True, False])) != tensor_hash(torch.tensor([False, True]))


def test_stats_round_trip_through_a_dict():
    s = summarize(seeded(3, 5))
    assert isinstance(s, TensorStats) and stats_from_dict(s.as_dict()) == s
