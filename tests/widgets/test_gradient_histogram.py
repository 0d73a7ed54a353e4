"""GradientHistogram: the heatmap, range bands and per-layer fractions follow the controls."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from opsnn_lab.precision import GradientStats, GradientTrace
from opsnn_lab.widgets import GradientHistogram


def recorded(steps=3):
    """Two parameters: ``small`` spans 2**-40..2**-20, ``big`` holds 2**0..2**9; recorded at scale 2**8."""
    model = nn.Module()
    model.small = nn.Parameter(torch.zeros(20))
    model.big = nn.Parameter(torch.zeros(10))
    stats = GradientStats(model, scale=2.0**8)
    for step in range(steps):
        model.small.grad = torch.exp2(-torch.arange(20.0, 40.0) - step)  # one element per octave
        model.big.grad = torch.exp2(torch.arange(10.0))
        if step == 2:
            model.big.grad[0] = math.inf
        stats.record(step)
    return stats


def shape_xs(widget, dash):
    return sorted(s.x0 for s in widget.figure.layout.shapes if s.type == "line" and s.line.dash == dash)


def test_heatmap_rows_are_each_parameters_share_per_octave():
    stats = recorded()
    w = GradientHistogram(stats)
    assert w.step.value == 2 and list(w.figure.data[0].y) == ["small", "big"]
    w.step.value = 0
    z = np.array(w.figure.data[0].z, dtype=float)
    lo, hi = w.trace.bins
    x = np.array(w.figure.data[0].x)
    small = {float(xv): zv for xv, zv in zip(x, z[0]) if np.isfinite(zv)}
    assert small == {e + 0.5: pytest.approx(1 / 20) for e in range(-39, -19)}  # 2**-39 .. 2**-20
    assert np.nansum(z[1]) == pytest.approx(1.0) and x[0] == lo - 0.5 and x[-1] == hi + 0.5
    w.step.value = 1  # the small parameter moved one octave down
    z1 = np.array(w.figure.data[0].z, dtype=float)
    assert np.isfinite(z1[0, x == -40 + 0.5]).all() and not np.isfinite(z1[0, x == -20 + 0.5]).any()


def test_bands_follow_the_recorded_and_the_chosen_scale():
    w = GradientHistogram(recorded())
    # fp16 at 2**8: underflow below 2**-24 -> unscaled 2**-32, normals from 2**-22, overflow at 2**8
    assert -32 in shape_xs(w, "dot") and -22 in shape_xs(w, "dash") and 8 in shape_xs(w, "solid")
    w.recorded_scale.value = False
    assert not w.scale_log2.disabled
    w.scale_log2.value = 16
    assert -40 in shape_xs(w, "dot") and 0 in shape_xs(w, "solid")
    assert "2**16" in w.figure.layout.title.text


def test_fraction_bars_match_the_trace_and_change_with_scale_and_format():
    w = GradientHistogram(recorded())
    w.step.value = 0
    bars = {d.name: np.array(d.x, dtype=float) for d in w.figure.data[1:]}
    # at 2**8 small's octaves -39..-20 land on -31..-12: the 7 octaves -39..-33 fall below fp16's 2**-24
    assert bars["underflow"][0] == pytest.approx(7 / 20) and bars["underflow"][1] == 0
    assert bars["subnormal"][0] == pytest.approx(10 / 20)  # octaves -32 .. -23
    assert bars["overflow"][1] == pytest.approx(2 / 10)  # 2**8, 2**9 scaled by 2**8 reach 2**16
    expect = w.trace.layer_fractions(0, scale=2.0**8)
    np.testing.assert_allclose(bars["overflow"], expect["overflow"])
    w.recorded_scale.value = False
    w.scale_log2.value = 0
    bars = {d.name: np.array(d.x, dtype=float) for d in w.figure.data[1:]}
    assert bars["underflow"][0] == pytest.approx(15 / 20) and bars["overflow"][1] == 0
    w.fmt.value = "bf16"
    bars = {d.name: np.array(d.x, dtype=float) for d in w.figure.data[1:]}
    assert bars["underflow"].sum() == 0 and bars["overflow"].sum() == 0
    assert "bf16" in w.summary.value


def test_summary_names_parameters_with_nonfinite_gradients():
    w = GradientHistogram(recorded())
    assert "Inf/NaN in big" in w.summary.value
    w.step.value = 1
    assert "Inf/NaN" not in w.summary.value and "small" in w.summary.value


def test_accepts_a_saved_trace(tmp_path):
    path = recorded().save(tmp_path / "trace.npz")
    w = GradientHistogram(path, fmt="bf16")
    assert w.fmt.value == "bf16" and len(w.figure.data) == 4


def test_bad_arguments():
    with pytest.raises(TypeError, match="stats_or_trace"):
        GradientHistogram({"not": "a trace"})
    with pytest.raises(ValueError, match="fmt"):
        GradientHistogram(recorded(), fmt="fp8")
    with pytest.raises(ValueError, match="stats_or_trace"):
        GradientHistogram(GradientTrace.from_amax([]))


def test_static_renderers_get_the_figure():
    from opsnn_lab.widgets._base import PLOTLY_MIME

    bundle = GradientHistogram(recorded())._repr_mimebundle_()
    assert [t["type"] for t in bundle[PLOTLY_MIME]["data"]] == ["heatmap", "bar", "bar", "bar"]


def test_rows_per_module_merge_weight_and_bias():
    model = nn.Linear(4, 3)
    model.extra = nn.Linear(2, 2)
    stats = GradientStats(model)
    model.weight.grad = torch.full((3, 4), 2.0**-3)
    model.bias.grad = torch.full((3,), 2.0**5)
    model.extra.weight.grad = torch.full((2, 2), 2.0**-30)
    model.extra.bias.grad = torch.zeros(2)
    stats.record(0)
    w = GradientHistogram(stats)  # by="module" is the default
    # top-level parameters keep their own names; extra.weight and extra.bias become one row
    assert list(w.figure.data[0].y) == w.trace.names == ["weight", "bias", "extra"]
    assert w.trace.param_numel.tolist() == [12, 3, 6] and w.trace.param_zeros[0].tolist() == [0, 0, 2]
    extra = np.array(w.figure.data[0].z, dtype=float)[2]
    assert np.nansum(extra) == pytest.approx(1.0)  # share of the module's 4 nonzero elements, all at 2**-30
    w.by.value = "parameter"
    assert list(w.figure.data[0].y) == ["weight", "bias", "extra.weight", "extra.bias"]
    assert list(w.figure.data[1].y) == list(w.figure.data[0].y) and "per parameter" in w.figure.layout.title.text
    with pytest.raises(ValueError, match="by"):
        GradientHistogram(stats, by="layer")
