"""The consistency benchmark runs CI-sized and writes both ratios (no timing assertions)."""

from __future__ import annotations

import json

from opsnn_lab.bench import consistency
from opsnn_lab.consistency import is_strict


def test_quick_run_writes_json(tmp_path, capsys):
    assert consistency.main(["--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "consistency.json").read_text())
    variants = [r["variant"] for r in data["rows"]]
    assert variants[:2] == ["default", "strict"]
    assert data["strict_ratio"] > 0 and data["strict_cpu_ratio"] > 0 and data["strict_switch_ms"] > 0
    if "trace" in variants:  # the checker is part of this build
        assert data["trace_ratio"] > 0
    else:
        assert data["trace_ratio"] is None
    assert data["threads"] == 1 and data["config"]["layers"] == 2
    paths = data["strict_gemm_paths"]  # which GEMM path the probe chose, per op: the strict steps ran some
    assert paths and {k.split(":")[0] for k in paths} <= {"mm", "bmm"} and all(v > 0 for v in paths.values())
    out = capsys.readouterr().out
    assert "strict" in out and "cpu_ratio" in out and "page_faults" in out
    assert all(isinstance(r["page_faults"], int) and r["page_faults"] >= 0 for r in data["rows"])
    assert not is_strict()
    if "trace" in variants:  # peak memory of traced steps, without a limit and with the step's peak as one
        unlimited, limited = data["memory"]
        assert data["memory_limit"] > 0 and unlimited["ok"] and limited["ok"]
        assert limited["reference_peak_ratio"] < unlimited["reference_peak_ratio"]
        assert limited["compared_peak_ratio"] < unlimited["compared_peak_ratio"]
        assert "trace memory" in out


def test_an_image_model_with_depthwise_convolutions(tmp_path, capsys):
    """``--model``: strict() on a zoo image model (ConvNeXt's 7x7 depthwise convolutions take fixed_conv's per-tap
    path), traced too."""
    assert consistency.main(["--quick", "--model", "convnext", "--threads", "1", "--no-memory",
                             "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "consistency.json").read_text())
    assert data["config"]["model"] == "convnext" and data["config"]["image"] == 32
    assert data["strict_ratio"] > 0 and [r["variant"] for r in data["rows"]][:2] == ["default", "strict"]
    assert "convnext: batch 4 x 3 x 32 x 32" in capsys.readouterr().out
    assert not is_strict()
