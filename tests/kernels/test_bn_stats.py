"""Batch statistics of the torch BN + activation path: the row-reduction statistics against fp64 on every layout
and dtype, the cases they hand to aten (fp64, a mean far from the spread, non-finite values), the running
statistics and the dtype of the saved statistics against ``F.batch_norm`` / aten."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from opsnn_lab.kernels import bn_act as K
from opsnn_lab.testing import assert_close_dtype, seeded


def _layouts(n, c, h, w, dtype):
    base = (seeded(n, c, h, w, seed=3, scale=2.0) + seeded(1, c, 1, 1, seed=4, scale=0.5)).to(dtype)
    wide = (seeded(n, c, h, w + 3, seed=5, scale=2.0) - 0.5).to(dtype)
    return {"contiguous": base, "channels_last": base.contiguous(memory_format=torch.channels_last),
            "sliced": wide[..., 1:-2], "transposed_hw": base.transpose(2, 3)}


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (5, 4, 1, 1), (1, 6, 3, 2), (3, 17, 11, 13)], ids=str)
def test_row_statistics_match_fp64(shape):
    y = _layouts(*shape, torch.float32)["contiguous"]
    stats = K._one_pass_stats(y)
    assert stats is not None
    ref_var, ref_mean = torch.var_mean(y.double(), (0, 2, 3), correction=0)
    mean, var = stats
    torch.testing.assert_close(mean, ref_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(var, ref_var, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_other_dtypes_keep_atens_statistics(dtype):
    """bf16/fp16: the fp32 row reductions would convert the whole tensor twice, where aten reads it once."""
    assert K._one_pass_stats(_layouts(3, 5, 6, 7, dtype)["contiguous"]) is None


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "transposed_hw"])
def test_other_layouts_keep_atens_statistics(layout):
    y = _layouts(3, 5, 6, 7, torch.float32)[layout]
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    assert K._one_pass_stats(y) is None


@pytest.fixture
def row_stats_at_any_size(monkeypatch):
    """The forward takes the row statistics at these small test shapes too."""
    monkeypatch.setattr(K, "ROW_STATS_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("size", ["small", "large"])
def test_small_tensors_take_atens_statistics_large_ones_the_rows(size):
    """Below ROW_STATS_MIN_ELEMENTS aten's one op is faster than ~20 small row reductions: its bits exactly."""
    c = 8
    hw = 4 if size == "small" else int((K.ROW_STATS_MIN_ELEMENTS // (2 * c)) ** 0.5) + 1
    y = seeded(2, c, hw, hw, seed=3, scale=2.0)
    weight, bias = seeded(c, seed=1).abs() + 0.5, seeded(c, seed=2)
    rm, rv = torch.zeros(c), torch.ones(c)
    out, mean, invstd, _ = K.bn_act_forward_torch(y, weight, bias, rm, rv, training=True, momentum=0.1,
                                                  eps=1e-5, act=K.Act("relu"))
    ref_rm, ref_rv = torch.zeros(c), torch.ones(c)
    z, ref_mean, ref_invstd = torch.ops.aten.native_batch_norm(y, weight, bias, ref_rm, ref_rv, True, 0.1, 1e-5)
    same = [torch.equal(a, b) for a, b in ((out, z.relu()), (mean, ref_mean), (invstd, ref_invstd), (rv, ref_rv))]
    if size == "small":
        assert all(same)
    else:
        assert K._one_pass_stats(y) is not None and not all(same)  # the row statistics: other rounding
        torch.testing.assert_close(out, z.relu())
        torch.testing.assert_close(rv, ref_rv)


def _forward_matches_batch_norm(y):
    c = y.shape[1]
    weight, bias = (seeded(c, seed=8).abs() + 0.5).to(y.dtype), seeded(c, seed=9).to(y.dtype)
    rm, rv = torch.zeros(c, dtype=y.dtype), torch.ones(c, dtype=y.dtype)
    out, _, _, _ = K.bn_act_forward_torch(y, weight, bias, rm, rv, training=True, momentum=0.1, eps=1e-5,
                                          act=K.Act("silu"))
    ref_rm, ref_rv = torch.zeros_like(rm), torch.ones_like(rv)
    ref = F.silu(F.batch_norm(y, ref_rm, ref_rv, weight, bias, True, 0.1, 1e-5))
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(rm, ref_rm, equal_nan=True)
    torch.testing.assert_close(rv, ref_rv, equal_nan=True)


@pytest.mark.parametrize("case", ["far_mean", "constant"])
def test_a_channel_far_from_its_mean_is_taken_again_in_two_passes(case, row_stats_at_any_size):
    y = seeded(4, 16, 5, 5, seed=7)
    k = 1 if case == "far_mean" else 2
    if case == "far_mean":
        y[:, k] += 1000.0  # 1000 standard deviations out: E[y^2] - mean^2 would cancel to noise in fp32
    else:
        y[:, k] = 2.5  # no spread at all: the one-pass variance is rounding noise
    stats = K._one_pass_stats(y)
    assert stats is not None
    ref_var, ref_mean = torch.var_mean(y.double(), (0, 2, 3), correction=0)
    torch.testing.assert_close(stats[0], ref_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(stats[1], ref_var, atol=1e-6, rtol=2e-6)
    # the retaken channel: fp64 two-pass, exact to fp64 rounding
    torch.testing.assert_close(stats[0][k], ref_mean[k], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(stats[1][k], ref_var[k], atol=1e-15, rtol=1e-9)
    _forward_matches_batch_norm(y)


@pytest.mark.parametrize("case", ["fp64", "many_far", "inf", "nan", "huge"])
def test_declined_statistics_fall_back_to_aten(case):
    y = seeded(4, 16, 5, 5, seed=7)
    if case == "fp64":
        y = y.double()
    elif case == "many_far":
        y[:, :3] += 1000.0  # more than an eighth of the channels: aten takes the whole tensor
    elif case == "huge":
        y[:, 4] *= 1e20  # finite values whose squares overflow fp32
    else:
        y[1, 0, 2, 2] = float(case)
    assert K._one_pass_stats(y) is None
    _forward_matches_batch_norm(y)


@pytest.mark.parametrize("momentum", [0.1, 1.0, 0.5])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_running_statistics_and_output_match_batch_norm(momentum, layout, row_stats_at_any_size):
    y = _layouts(3, 5, 6, 7, torch.float32)[layout]
    weight, bias = seeded(5, seed=1).abs() + 0.5, seeded(5, seed=2)
    rm, rv = seeded(5, seed=3, scale=0.1), seeded(5, seed=4).abs() + 0.5
    ref_rm, ref_rv = rm.clone(), rv.clone()
    out, mean, invstd, _ = K.bn_act_forward_torch(y, weight, bias, rm, rv, training=True, momentum=momentum,
                                                  eps=1e-3, act=K.Act("hardswish"))
    ref = F.hardswish(F.batch_norm(y, ref_rm, ref_rv, weight, bias, True, momentum, 1e-3))
    assert_close_dtype(out, ref, msg="output")
    assert_close_dtype(rm, ref_rm, msg="running_mean")
    assert_close_dtype(rv, ref_rv, msg="running_var")
    ref_var, ref_mean = torch.var_mean(y.double(), (0, 2, 3), correction=0)
    assert_close_dtype(mean, ref_mean.float(), msg="mean")
    assert_close_dtype(invstd, (ref_var + 1e-3).rsqrt().float(), msg="invstd")


@pytest.mark.parametrize("y_dtype,param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=str)
@pytest.mark.parametrize("with_params", [True, False])
def test_saved_statistics_have_atens_dtype(y_dtype, param_dtype, with_params, row_stats_at_any_size):
    """aten's batch-norm backward, which the torch path's backward calls, asks for the dtype its forward gives."""
    y = seeded(2, 3, 4, 5, seed=1).to(y_dtype)
    params = [torch.ones(3, dtype=param_dtype), torch.zeros(3, dtype=param_dtype)] if with_params else [None, None]
    running = [torch.zeros(3, dtype=param_dtype), torch.ones(3, dtype=param_dtype)]
    _, mean, invstd, _ = K.bn_act_forward_torch(y, *params, *running, training=True, momentum=0.1, eps=1e-5)
    _, ref_mean, ref_invstd = torch.ops.aten.native_batch_norm(y, *params, *[r.clone() for r in running], True,
                                                               0.1, 1e-5)
    assert (mean.dtype, invstd.dtype) == (ref_mean.dtype, ref_invstd.dtype)
    g = seeded(*y.shape, seed=2).to(y_dtype)
    got = torch.ops.aten.native_batch_norm_backward(g, y, params[0], None, None, mean, invstd, True, 1e-5,
                                                    [True, with_params, with_params])
    ref = torch.ops.aten.native_batch_norm_backward(g, y, params[0], None, None, ref_mean, ref_invstd, True, 1e-5,
                                                    [True, with_params, with_params])
    for a, b in zip(got, ref):
        if b is not None:
            assert_close_dtype(a, b)
