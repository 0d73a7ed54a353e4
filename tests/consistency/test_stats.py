"""Per-tensor statistics and the bitwise hash."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.consistency import stats
from opsnn_lab.consistency.stats import TensorStats, stats_from_dict, summarize, summarize_many, tensor_hash
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
    assert summarize(x, known_hash=tensor_hash(x)) == s  # a hash the caller has is not computed again
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


def test_summarize_many_gives_each_tensor_its_own_hash_and_statistics():
    # small float32 tensors are summarised together (segment sums over one concatenation); every
    # tensor must still get exactly its own hash and its own statistics, whatever sits next to it
    odd = seeded(5, 7, seed=3)
    odd[1, 2], odd[3, 3], odd[4, 0] = math.nan, math.inf, -math.inf
    tensors = [seeded(3, 5, seed=1), seeded(1, seed=2), odd, non_contiguous(seeded(6, 4, seed=4)),
               torch.zeros(0, 3), torch.arange(7), seeded(4, 4, dtype=torch.bfloat16, seed=5),
               seeded(40000, seed=6), seeded(3, 5, seed=1).flip(0), torch.full((9,), 1e30), seeded(2, 3, seed=7)]
    many = summarize_many(tensors)
    assert len(many) == len(tensors)
    for t, got in zip(tensors, many):
        want = summarize(t)
        assert got.hash == want.hash == tensor_hash(t), t.shape
        assert (got.shape, got.dtype, got.nan, got.inf) == (want.shape, want.dtype, want.nan, want.inf)
        for k in ("min", "max"):
            assert getattr(got, k) == getattr(want, k), (t.shape, k)
        for k in ("mean", "std", "norm"):
            assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-5, abs=1e-6), (t.shape, k)
    assert many[0].hash != many[8].hash  # the same values in another order
    assert (many[2].nan, many[2].inf) == (1, 2)
    assert summarize_many([]) == []


def _hash_by_definition(t: torch.Tensor) -> str:
    """The hash spelled out in Python integers: element i (as int32 bits) times u[i // 1024] * v[i % 1024]."""
    bits = t.detach().contiguous().reshape(-1).view(torch.int32).tolist()

    def odd(i, mul, add):
        return ((i * mul + add) & 0x7FFFFFFF) | 1

    weighted = sum(x * odd(i // 1024, 0x9E3779B1, 0x7F4A7C15) * odd(i % 1024, 0x85EBCA6B, 0x2545F491)
                   for i, x in enumerate(bits))
    return f"{weighted & 0xFFFFFFFF:08x}{sum(bits) & 0xFFFFFFFF:08x}"


@pytest.mark.parametrize("gemm", [True, False])  # full rows by one integer GEMM / by products and sums (CUDA)
@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 40000, 70001, 140001])
def test_hash_matches_its_definition_on_every_path(n, gemm, monkeypatch):
    # small tensors go through summarize_many's concatenation, full 1024-rows through an integer GEMM or
    # products and row sums, the rest elementwise: each must give the hash of the definition, computed
    # here in Python integers
    monkeypatch.setattr(stats, "_INT_GEMM", {"cpu"} if gemm else set())
    t = seeded(n, seed=n)
    want = _hash_by_definition(t)
    assert tensor_hash(t) == summarize(t).hash == summarize_many([t])[0].hash == want


_LAYOUTS = {  # the contiguous tensor's shape, and the view taken of it
    "transposed": ((90, 1100), lambda x: x.t()),
    "permuted 3-d": ((6, 50, 70), lambda x: x.permute(2, 0, 1)),
    "channels last": ((3, 8, 9, 11), lambda x: x.to(memory_format=torch.channels_last)),
    "size-1 dims": ((1, 900, 1, 3), lambda x: x.transpose(1, 3)),
    "sliced": ((40, 900), lambda x: x[:, 1:-2]),
    "expanded": ((1, 2000), lambda x: x.expand(3, 2000)),
}


@pytest.mark.parametrize("copy", [False, True])  # in memory order with permuted weights / by a contiguous copy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.float64])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_a_strided_tensor_hashes_and_summarises_as_its_contiguous_copy(layout, dtype, copy, monkeypatch):
    # a transposed weight (what a Linear hands its GEMM) is hashed where it lies, without the copy: the
    # hash must still be the one of its logical order, the definition's, and the statistics the same
    if copy:
        monkeypatch.setattr(stats, "_PERMUTED_MAX", 0)
    shape, view = _LAYOUTS[layout]
    x = seeded(*shape, seed=len(layout))
    t = view(x.mul(1e6).int() if dtype == torch.int32 else x.to(dtype))
    assert not t.is_contiguous()
    c = t.contiguous()
    want = _hash_by_definition(c) if c.element_size() == 4 else tensor_hash(c)
    assert tensor_hash(t) == want
    got, ref = summarize(t), summarize(c)
    assert got.hash == want and got.shape == tuple(t.shape)
    assert (got.min, got.max, got.nan, got.inf) == (ref.min, ref.max, ref.nan, ref.inf)
    for k in ("mean", "std", "norm"):
        assert getattr(got, k) == pytest.approx(getattr(ref, k), rel=1e-5, abs=1e-6), k
    assert stats.hash_many([t]) == [want]


def test_permuted_hash_weights_stay_within_their_budget(monkeypatch):
    monkeypatch.setattr(stats, "_PERMUTED_BUDGET", 3 * 256 * 256)
    monkeypatch.setattr(stats, "_permuted", {})
    for rows in range(200, 300, 10):
        t = seeded(rows, 256, seed=rows).t()
        assert tensor_hash(t) == _hash_by_definition(t)
        assert sum(w.numel() for w in stats._permuted.values()) <= 3 * 256 * 256


LARGE = 1024 * 1023 + 517  # > summarize_many's SMALL, full rows and a tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("where", [0, 1023, 1024, LARGE // 2, LARGE - 517, LARGE - 1])
def test_hash_sees_one_flipped_bit_anywhere_in_a_large_tensor(dtype, where):
    x = seeded(LARGE, dtype=dtype, seed=3)
    h = tensor_hash(x)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for bit in (0, 8 * x.element_size() - 2, 8 * x.element_size() - 1):  # 1 ulp, an exponent bit, the sign
        y = x.clone()
        y.view(ints)[where] ^= (1 << bit) if bit < 8 * x.element_size() - 1 else -(1 << bit)
        assert not torch.equal(y.view(ints), x.view(ints))
        assert tensor_hash(y) != h, (where, bit)
        assert summarize_many([y])[0].hash != h


def test_hash_sees_a_reordering_that_keeps_every_sum():
    # a 2x2 rotation keeps the total, each row's and each column's sum: only weights that depend on the
    # position of each element (not on its row or its column alone) see it
    x = seeded(2048, 1024, seed=5)
    h = tensor_hash(x)
    a, b = x[7, 3].clone(), x[7, 900].clone()
    y = x.clone()
    y[7, 3], y[7, 900], y[1500, 3], y[1500, 900] = a, b, b, a
    x2 = y.clone()
    x2[7, 3], x2[7, 900], x2[1500, 3], x2[1500, 900] = b, a, a, b
    moved = {"rotation": (tensor_hash(y), tensor_hash(x2)), "roll": (h, tensor_hash(x.roll(1))),
             "rows swapped": (h, tensor_hash(x[[1, 0, *range(2, 2048)]])),
             "columns swapped": (h, tensor_hash(x[:, [1, 0, *range(2, 1024)]]))}
    for name, (before, after) in moved.items():
        assert before[8:] == after[8:], name  # the plain sum of the bits is blind to the move ...
        assert before != after, name          # ... the position-weighted word is not


def test_hash_many_gives_tensor_hash_for_every_kind_of_tensor():
    # the small 4-byte ones go through one concatenation: each must still get its own tensor_hash
    tensors = [seeded(5, seed=1), seeded(3, 7, seed=2), torch.arange(11, dtype=torch.int32),
               seeded(300, 200, seed=3), seeded(6, 4, seed=4).t(), torch.zeros(0), torch.ones(9, dtype=torch.bool),
               seeded(33, dtype=torch.bfloat16, seed=5), seeded(17, dtype=torch.float64, seed=6), seeded(5, seed=1)]
    assert stats.hash_many(tensors) == [tensor_hash(t) for t in tensors]
    assert len(set(stats.hash_many(tensors[:4]))) == 4


@pytest.mark.parametrize("n", [1000, 50000])
def test_std_of_values_far_from_their_mean_is_taken_centred(n):
    """E[x^2] - mean^2 cancels for 1000 +- 0.001 (fp32 sums: std read 0 or ~0.06); the std is taken again."""
    x = 1000.0 + 1e-3 * seeded(n, seed=3)
    want = x.double().std().item()
    for got in (summarize(x), summarize_many([x])[0], summarize_many([x, seeded(3, seed=1)])[0]):
        assert got.std == pytest.approx(want, rel=1e-4)
        assert got.mean == pytest.approx(x.double().mean().item(), rel=1e-6)
    y = x.clone()
    y[0] = math.nan
    assert summarize(y).std == pytest.approx(x[1:].double().std().item(), rel=1e-4)
    assert summarize(torch.full((9,), 1000.0)).std == 0.0
