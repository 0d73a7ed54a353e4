"""DivergenceViewer: controls change the figure's data; the selection shows both runs' statistics."""

from __future__ import annotations

import math

import pytest
import torch

from opsnn_lab.consistency import ConsistencyChecker
from opsnn_lab.models import EncoderConfig, MaskedTokenTask
from opsnn_lab.widgets import DivergenceViewer

TASK = MaskedTokenTask(batch_size=2, seq_len=8)


def _report(perturb: bool, memory_limit=None):
    torch.manual_seed(0)
    model = TASK.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    checker = ConsistencyChecker(dump_on_failure=False, memory_limit=memory_limit)
    for step in range(2):
        if step and perturb:
            w = model.layers[1].mlp.fc1.weight
            with torch.no_grad():
                w.add_(1e-4 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        model.zero_grad(set_to_none=True)
        with checker.trace(model):
            TASK.loss(model, TASK.batch(0)).backward()
    return checker.report


@pytest.fixture(scope="module")
def diverged():
    return _report(True)


def test_initial_view_marks_the_first_divergence(diverged):
    v = DivergenceViewer(diverged)
    err, tol, first, sel = v.figure.data
    assert v.figure.layout.yaxis.type == "log"
    assert v.phase.value == "forward"
    fwd = diverged.forward_divergence
    assert list(first.x) == [fwd.index] and first.y[0] == pytest.approx(fwd.max_abs_err)
    assert len(err.x) == len([r for r in diverged.rows if r.phase == "forward"])
    assert list(err.x) == sorted(err.x)       # execution order
    assert set(tol.y) == {1e-6}
    # zeros are drawn on the floor, errors as they are
    assert min(err.y) == pytest.approx(1e-12) and max(err.y) == pytest.approx(
        max(r.max_abs_err for r in diverged.rows if r.phase == "forward"))
    assert v.op_select.value == fwd.index and list(sel.x) == [fwd.index]
    assert "layers.1.mlp.fc1" in v.details.value and "reference" in v.details.value


def test_phase_toggle_switches_rows_and_marker(diverged):
    v = DivergenceViewer(diverged)
    v.phase.value = "backward"
    back = [r.index for r in diverged.rows if r.phase == "backward"]
    assert list(v.figure.data[0].x) == back
    assert list(v.figure.data[2].x) == [diverged.backward_divergence.index]
    assert v.op_select.value is None      # the forward selection is not in view any more
    v.phase.value = "all"
    assert len(v.figure.data[0].x) == len(diverged.rows)


def test_module_filter_and_metric(diverged):
    v = DivergenceViewer(diverged)
    v.module_filter.value = "layers.0.attention"
    rows = v.visible_rows()
    assert rows and all("layers.0.attention" in r.module_path for r in rows)
    assert list(v.figure.data[0].x) == [r.index for r in rows]
    assert list(v.figure.data[2].x) == []          # the first divergence is in layers.1
    v.module_filter.value = ""
    v.metric.value = "ULP distance"
    ulps = [r.ulp for r in diverged.rows if r.phase == "forward"]
    assert list(v.figure.data[0].y) == [None if u is None else max(u, 1e-12) for u in ulps]
    assert list(v.figure.data[1].y) == []         # no tolerance line for ULPs
    assert "ULP" in v.figure.layout.yaxis.title.text


def test_selecting_an_op_shows_both_runs_statistics(diverged):
    v = DivergenceViewer(diverged)
    row = next(r for r in diverged.rows if r.phase == "forward" and r.module_path == "head" and r.kind == "op")
    v.op_select.value = row.index
    assert list(v.figure.data[3].x) == [row.index]
    for stats in (row.ref_stats[0], row.run_stats[0]):
        assert stats["hash"] in v.details.value
    # a click on a point selects it too
    trace = v.figure.data[0]
    pos = list(trace.x).index(row.index - 1)

    class _Points:
        point_inds = [pos]

    v._clicked(trace, _Points(), None)
    assert v.op_select.value == row.index - 1


def test_ok_report_and_bad_argument():
    v = DivergenceViewer(_report(False))
    assert "ok" in v.details.value and list(v.figure.data[2].x) == []
    assert all(y == pytest.approx(1e-12) for y in v.figure.data[0].y if y is not None and not math.isnan(y))
    with pytest.raises(TypeError, match="report"):
        DivergenceViewer([1, 2])


def test_rows_past_a_memory_limit_show_a_lower_bound_from_statistics():
    report = _report(True, memory_limit=0)
    v = DivergenceViewer(report)
    fwd = report.forward_divergence
    assert fwd.measured == "statistics" and f"max abs &ge; {fwd.max_abs_err:.3g}" in v.details.value
    assert report.unresolved_rows()  # later rows whose extremes stay put: named in the summary
    assert "differ in bits within what their statistics show" in v.details.value
    v.op_select.value = fwd.index
    assert "from statistics, past the memory limit; beyond tolerance" in v.details.value
    assert "nan%" not in v.details.value
