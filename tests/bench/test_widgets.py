"""The widgets benchmark runs CI-sized, and its synthetic trace looks like a real run."""

from __future__ import annotations

import json

import numpy as np
import torch

from opsnn_lab.bench import widgets


def test_synthetic_trace_has_overflows_nonfinite_steps_and_full_histograms():
    trace = widgets.synthetic_trace(4000, seed=1)
    assert len(trace) == 4000
    assert 0 < trace.nonfinite.sum() < 20  # about one in 2,000
    over = trace.overflow(2.0**16)
    assert 5 < (over & ~trace.nonfinite).sum() < 40  # the amax spikes, about one in 300
    assert abs(trace.counts[:, :-2].sum(1) - 2**17).max() < 300  # rounding of the per-octave counts
    assert np.all(trace.underflow_fraction(1.0) > trace.underflow_fraction(2.0**16))


def test_quick_run_writes_json(tmp_path, capsys):
    torch.set_num_threads(2)
    assert widgets.main(["--trace-steps", "300", "--repeat", "1", "--train-repeat", "1", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == 2  # its one-thread run ends with the caller's count
    data = json.loads((tmp_path / "widgets.json").read_text())
    assert data["machine"]["threads"] == 1  # the JSON says how the figures were measured
    assert data["redraw_s"] > 0 and np.isfinite(data["grad_stats_overhead"])
    assert [r["case"].split(": ")[1] for r in data["tuner"]] == [
        "replay only", "underflow at replayed scales", "slider -> redraw"]
    assert len(data["grad_stats"]) == 3
    out = capsys.readouterr().out
    assert "ScalerTuner redraw" in out and "GradientStats overhead" in out
