import math

import pytest
import torch

from opsnn_lab.precision import FP16_MAX, FP16_MIN, LocalScaler
from opsnn_lab.precision.local_scaler import NonFiniteGradientError, flush_fraction, pow2_scale
from opsnn_lab.testing import non_contiguous, seeded


def test_constants():
    assert FP16_MAX == float(torch.finfo(torch.float16).max)
    assert FP16_MIN == float(torch.finfo(torch.float16).tiny)


@pytest.mark.parametrize("amax, world, expected", [
    (FP16_MAX, 1, 1.0), (65505.0, 1, 2.0), (1.0, 1, 2.0**-15), (1e-9, 1, 2.0**-45),
    (1e5, 1, 2.0), (1e5, 2, 4.0), (1e5, 3, 8.0), (0.0, 4, 1.0),
])
def test_pow2_scale_is_the_seed_formula(amax, world, expected):
    assert pow2_scale(amax, FP16_MAX, world) == expected
    if amax:  # the seed's formula, with the world-size headroom inside
        assert expected == 2.0 ** math.ceil(math.log2(amax * world / FP16_MAX))


@pytest.mark.parametrize("dtype, rtol", [(torch.float16, 2**-11), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("magnitude", [1e-9, 1e-3, 1.0, 1e5, 1e20])
def test_cast_round_trip_within_dtype_precision(dtype, rtol, magnitude):
    g = seeded(37, 29, seed=3, scale=magnitude)
    low, scale = LocalScaler(dtype).cast(g)
    assert low.dtype == dtype and math.log2(scale).is_integer()
    assert torch.isfinite(low).all()
    back = LocalScaler(dtype).unscale(low, scale)
    # normals keep rtol; elements far below amax may land in subnormals and keep absolute precision
    torch.testing.assert_close(back, g, rtol=rtol, atol=g.abs().max().item() * 2**-24)


def test_scaling_is_exact_power_of_two():
    g = torch.tensor([3.0, -0.375, 1.5]) * 2.0**-40  # all exact in fp16 after scaling
    low, scale = LocalScaler().cast(g)
    assert torch.equal(low.float() * scale, g)


def test_tiny_gradient_survives_where_a_plain_cast_flushes():
    g = torch.full((5,), 1e-9)
    assert (g.half() == 0).all()
    low, scale = LocalScaler().cast(g)
    assert (low != 0).all() and low.float().abs().max() <= FP16_MAX
    torch.testing.assert_close(low.float() * scale, g, rtol=1e-3, atol=0)


def test_world_size_headroom_allows_summing_ranks():
    g = torch.tensor([FP16_MAX * 3.0, -1.0])
    s = LocalScaler(world_size=4)
    low, scale = s.cast(g)
    total = low + low + low + low  # fp16 arithmetic
    assert torch.isfinite(total).all()
    torch.testing.assert_close(total.float() * scale, 4 * g, rtol=1e-3, atol=0)


def test_zeros_empty_and_non_contiguous():
    s = LocalScaler()
    low, scale = s.cast(torch.zeros(4))
    assert scale == 1.0 and torch.equal(low, torch.zeros(4, dtype=torch.float16))
    low, scale = s.cast(torch.empty(0, 3))
    assert scale == 1.0 and low.shape == (0, 3)
    g = non_contiguous(seeded(6, 5, seed=1, scale=1e-6))
    low, scale = s.cast(g)
    torch.testing.assert_close(low.float() * scale, g, rtol=1e-3, atol=1e-12)


def test_nonfinite_is_reported_not_cast():
    g = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    with pytest.raises(NonFiniteGradientError, match="1 NaN and 2 Inf"):
        LocalScaler().cast(g)
    s = LocalScaler(nonfinite="keep")
    low, scale = s.cast(g)
    assert scale == 1.0 and torch.isnan(low[1]) and not s.last_report.finite
    assert (s.last_report.nan, s.last_report.inf) == (1, 2)


def test_report_counts_flushed_elements():
    g = torch.tensor([1e4, 1e-9, 0.0])  # scale 2**-2: 4e-9 is below half of fp16s smallest subnormal
    s = LocalScaler()
    low, _ = s.cast(g)
    assert low[1] == 0 and s.last_report.flushed == 1 and s.last_report.numel == 3


def test_flush_fraction():
    g = torch.tensor([1.0, 2.0**-25, 2.0**-24, 0.0])
    assert flush_fraction(g) == 0.25
    assert flush_fraction(g, scale=2.0) == 0.0
    assert flush_fraction([g.half()]) == 0.0
    assert flush_fraction([]) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        LocalScaler(dtype=torch.float32)
    with pytest.raises(ValueError, match="world_size"):
        LocalScaler(world_size=0)
    with pytest.raises(ValueError, match="nonfinite"):
        LocalScaler(nonfinite="ignore")
    with pytest.raises(TypeError, match="grad"):
        LocalScaler().cast([1.0])
    with pytest.raises(TypeError, match="grad"):
        LocalScaler().cast(torch.ones(2, dtype=torch.int64))
