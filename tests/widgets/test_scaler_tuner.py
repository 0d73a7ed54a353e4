"""ScalerTuner: each control changes the replay the way DynamicScaler's rules say it must."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from opsnn_lab.precision import FP16_MIN, DynamicScaler, GradientStats, GradientTrace
from opsnn_lab.precision.grad_stats import EXP_MIN, N_BINS
from opsnn_lab.widgets import ScalerTuner


def trace(amax, counts=None):
    return GradientTrace.from_amax(amax, counts=counts)


def decreases(scale) -> int:
    return int((np.diff(scale) < 0).sum())


def increases(scale) -> int:
    return int((np.diff(scale) > 0).sum())


def test_lower_init_scale_skips_fewer_steps_on_a_trace_that_overflows():
    amax = np.full(60, 2.0**3)  # 8 * 2**16 overflows fp16; 8 * 2**10 does not
    tuner = ScalerTuner(trace(amax), init_scale=2.0**16, growth_interval=1000)
    high = tuner.result
    assert high["skipped"][:4].all() and high["scale"][0] == 2.0**16
    before = [np.array(d.y, dtype=float).copy() for d in tuner.figure.data[1:3]]
    tuner.init_scale_log2.value = 10
    low = tuner.result
    assert low["scale"][0] == 2.0**10 and low["skipped"].sum() == 0 < high["skipped"].sum() == 4
    # the figure shows the new replay: scale line and no overflow markers
    np.testing.assert_array_equal(tuner.figure.data[1].y, np.log2(low["scale"]))
    assert len(tuner.figure.data[2].x) == 0 and len(before[1]) == 4
    assert "init_scale=2**10" in tuner.code.value and "0 skipped" in tuner.summary.value


def test_growth_factor_sets_the_ratio_of_each_growth():
    tuner = ScalerTuner(trace(np.full(50, 2.0**-4)), init_scale=2.0**4, growth_interval=10, underflow_growth=False)
    s2 = tuner.result["scale"]
    tuner.growth_factor.value = 4.0
    s4 = tuner.result["scale"]
    assert increases(s2) == increases(s4) == 4  # after steps 10, 20, 30, 40
    assert s2[-1] == 2.0**(4 + 4) and s4[-1] == 2.0**(4 + 8)
    assert "growth_factor=4" in tuner.call


def test_backoff_factor_sets_the_drop_after_an_overflow():
    amax = np.full(20, 2.0**-4)
    amax[5] = math.inf
    tuner = ScalerTuner(trace(amax), init_scale=2.0**12, growth_interval=1000)
    assert tuner.result["scale"][6] == 2.0**11 and tuner.result["skipped"].tolist().count(True) == 1
    tuner.backoff_factor.value = 0.25
    assert tuner.result["scale"][5] == 2.0**12 and tuner.result["scale"][6] == 2.0**10


def test_growth_interval_sets_how_often_the_scale_grows():
    tuner = ScalerTuner(trace(np.full(100, 2.0**-6)), init_scale=1.0, growth_interval=50, underflow_growth=False)
    assert increases(tuner.result["scale"]) == 1
    tuner.growth_interval.value = 10
    assert increases(tuner.result["scale"]) == 9 and tuner.result["scale"][-1] == 2.0**9


def test_hysteresis_backs_off_only_after_that_many_overflows():
    amax = np.full(40, 2.0**-4)
    amax[[5, 15, 25, 35]] = math.nan  # isolated non-finite steps
    tuner = ScalerTuner(trace(amax), init_scale=2.0**12, growth_interval=1000, hysteresis=1)
    one = tuner.result
    tuner.hysteresis.value = 2
    two = tuner.result
    assert one["skipped"].sum() == two["skipped"].sum() == 4  # an overflow step is always skipped
    # Megatron's rule: the first overflow since the last growth is tolerated, later ones back off
    assert decreases(one["scale"]) == 4 and decreases(two["scale"]) == 3
    assert two["scale"][6] == 2.0**12 and two["scale"][16] == 2.0**11
    tuner.growth_interval.value = 8  # 9 clean steps between overflows: each growth resets the count
    assert decreases(tuner.result["scale"]) == 0 and increases(tuner.result["scale"]) == 3
    tuner.hysteresis.value = 1
    assert decreases(tuner.result["scale"]) == 4


def test_underflow_growth_checkbox():
    amax = np.full(30, 2.0**-30)  # amax * 2**10 = 2**-20 < FP16_MIN: the seed's rule grows until it is not
    counts = np.zeros((30, N_BINS), dtype=np.int64)
    counts[:, -40 - EXP_MIN:-30 - EXP_MIN] = 100  # elements from 2**-40 to 2**-30
    tuner = ScalerTuner(trace(amax, counts), init_scale=2.0**10, growth_interval=1000, underflow_growth=True)
    on = tuner.result
    assert on["underflow"][:6].all() and not on["underflow"][6:].any() and on["scale"][-1] == 2.0**16
    assert len(tuner.figure.data[3].x) == 6
    tuner.underflow_growth.value = False
    off = tuner.result
    assert off["skipped"].sum() == 0 and (off["scale"] == 2.0**10).all()
    # at 2**10 every element (2**-40..2**-30 -> 2**-30..2**-20) is below 2**-24 for 60%; at 2**16 none is
    assert off["underflow_fraction"][-1] == pytest.approx(0.6)
    assert on["underflow_fraction"][-1] == pytest.approx(0.0)
    np.testing.assert_allclose(tuner.figure.data[4].y, off["underflow_fraction"])
    assert "underflow_threshold=None" in tuner.call


def test_call_builds_the_scaler_that_was_replayed():
    rng = np.random.default_rng(0)
    amax = np.exp2(rng.normal(-2, 3, 300))
    amax[rng.integers(0, 300, 5)] = math.inf
    tuner = ScalerTuner(trace(amax))
    tuner.growth_factor.value, tuner.backoff_factor.value, tuner.hysteresis.value = 3.0, 0.35, 2
    scaler = eval(tuner.call, {"DynamicScaler": DynamicScaler, "FP16_MIN": FP16_MIN})
    assert scaler.state_dict() == tuner.scaler().state_dict()
    np.testing.assert_array_equal(scaler.replay(amax.tolist())["scale"], tuner.result["scale"])


def test_accepts_stats_and_saved_traces(tmp_path):
    model = nn.Linear(3, 2)
    stats = GradientStats(model)
    for step in range(3):
        model.weight.grad = torch.full((2, 3), 2.0**[0, 1, -1][step])
        model.bias.grad = torch.zeros(2)
        stats.record(step)
    assert len(ScalerTuner(stats).result["scale"]) == 3
    path = stats.save(tmp_path / "t.npz")
    tuner = ScalerTuner(str(path), init_scale=2.0**15)
    assert tuner.result["overflow"].tolist() == [False, True, False]  # 2 * 2**15 = 65536 rounds to inf
    assert len(ScalerTuner(trace(np.zeros(0))).result["scale"]) == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="trace"):
        ScalerTuner([1.0, 2.0])
    with pytest.raises(ValueError, match="init_scale"):
        ScalerTuner(trace(np.ones(3)), init_scale=2.0**30)
    with pytest.raises(ValueError, match="min_scale"):
        ScalerTuner(trace(np.ones(3)), min_scale=0.0)


def test_static_renderers_get_the_figure():
    from opsnn_lab.widgets._base import PLOTLY_MIME

    tuner = ScalerTuner(trace(np.full(10, 2.0**-4)))
    data = tuner._repr_mimebundle_()[PLOTLY_MIME]["data"]
    assert [d["name"] for d in data][:2] == ["overflow ceiling", "log2 scale"] and len(data) == 5
