"""Per-op metrics and the report's views (JSON, HTML, repr)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from opsnn_lab.consistency.report import (
    ConsistencyReport,
    Divergence,
    Row,
    merge_errors,
    tensor_errors,
    tolerance_for,
)


@pytest.mark.parametrize("dtype, atol, rtol", [
    (torch.float64, 1e-12, 1e-12),
    (torch.float32, 1e-6, 1e-5),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 1e-2, 1.6e-2),
    (torch.int64, 0.0, 0.0),
])
def test_default_tolerance_per_dtype(dtype, atol, rtol):
    assert tolerance_for(dtype, None) == (atol, rtol)
    assert tolerance_for(dtype, 1e-6) == (1e-6, 1e-6)


def test_errors_of_known_tensors():
    ref = torch.tensor([1.0, -2.0, 0.0, 4.0])
    run = torch.tensor([1.0, -2.5, 1e-3, 4.0])
    e = tensor_errors(run, ref, atol=1e-6, rtol=1e-6)
    assert e["max_abs_err"] == pytest.approx(0.5)
    # the zero in the reference is floored at atol: 1e-3 / 1e-6
    assert e["max_rel_err"] == pytest.approx(1e-3 / 1e-6, rel=1e-4)
    assert e["frac_beyond"] == pytest.approx(0.5)
    cos = float(torch.nn.functional.cosine_similarity(run.double(), ref.double(), dim=0))
    assert e["cosine"] == pytest.approx(cos)
    assert not e["exact"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_ulp_distance_counts_representable_values(dtype):
    ref = torch.tensor([1.0, -1.0, 0.0], dtype=dtype)
    up = torch.nextafter(ref, torch.full_like(ref, math.inf))
    assert tensor_errors(up, ref, 0.0, 0.0)["ulp"] == 1
    three = torch.nextafter(torch.nextafter(up, torch.full_like(up, math.inf)), torch.full_like(up, math.inf))
    assert tensor_errors(three, ref, 0.0, 0.0)["ulp"] == 3
    # crossing zero: from -tiny to +tiny is 2 steps
    tiny = torch.tensor([torch.finfo(dtype).tiny], dtype=dtype)
    assert tensor_errors(tiny, -tiny, 0.0, 0.0)["ulp"] == 2 * int(tiny.view(
        {8: torch.int64, 4: torch.int32, 2: torch.int16}[tiny.element_size()]))


def test_identical_tensors_are_exact_and_nan_positions_must_match():
    a = torch.tensor([1.0, float("nan"), float("inf")])
    e = tensor_errors(a.clone(), a, 1e-6, 1e-6)
    assert e["exact"] and e["max_abs_err"] == 0 and e["frac_beyond"] == 0 and e["ulp"] == 0
    b = torch.tensor([1.0, 2.0, float("inf")])
    e = tensor_errors(b, a, 1e-6, 1e-6)
    assert e["max_abs_err"] == math.inf and e["frac_beyond"] == pytest.approx(1 / 3)


def test_shape_mismatch_empty_and_dtype_mismatch():
    assert tensor_errors(torch.zeros(2), torch.zeros(3), 1e-6, 1e-6)["max_abs_err"] == math.inf
    assert tensor_errors(torch.zeros(0, 4), torch.zeros(0, 4), 1e-6, 1e-6)["exact"]
    e = tensor_errors(torch.ones(3, dtype=torch.float16), torch.ones(3), 1e-3, 1e-3)
    assert e["max_abs_err"] == 0 and e["ulp"] is None and not e["exact"]


def test_errors_on_non_contiguous_input():
    ref = torch.arange(12.0).reshape(3, 4)
    run = ref.clone()
    run[1, 2] += 0.25
    assert not run.t().is_contiguous()
    e = tensor_errors(run.t(), ref.t(), 1e-6, 1e-6)
    assert e["max_abs_err"] == pytest.approx(0.25) and e["ulp"] > 0


def test_merge_takes_the_worst_output():
    e = merge_errors([tensor_errors(torch.ones(2), torch.ones(2), 0, 0),
                      tensor_errors(torch.tensor([1.0, 3.0]), torch.ones(2), 0, 0)])
    assert e["max_abs_err"] == 2.0 and not e["exact"] and e["frac_beyond"] == 0.5


def _row(i, phase, diverged, err):
    return Row(i, phase, "op", "aten.addmm.default", "layers.0.mlp.fc1", "models.py:116", 0, i, i,
               not diverged, diverged, err, err, 1.0 - err, 3 if diverged else 0, 0.5 if diverged else 0.0,
               1e-6, 1e-6, origin="input" if diverged else "")


def test_report_views():
    div = Divergence("aten.addmm", "layers.0.mlp.fc1", "models.py:116", "forward", 1, 1e-3, math.inf, 0.99, 3,
                     0.5, "input", {"reference": [], "run": []}, {"reference": [], "run": []}, "aten.addmm.default")
    report = ConsistencyReport(rows=[_row(0, "forward", False, 0.0), _row(1, "forward", True, 1e-3)],
                               forward_divergence=div)
    assert not report.ok and report.first_divergence is div
    data = json.loads(report.to_json())   # strict JSON: inf written as a string
    assert data["forward_divergence"]["max_rel_err"] == "inf" and len(data["rows"]) == 2
    assert "layers.0.mlp.fc1" in report._repr_html_() and "DIVERGED" in report._repr_html_()
    assert "layers.0.mlp.fc1" in repr(report) and "layers.0.mlp.fc1" in str(div)
    ok = ConsistencyReport(rows=[_row(0, "forward", False, 0.0)])
    assert ok.ok and ok.first_divergence is None and ok.max_abs_err == 0.0
    assert ">ok<" in ok._repr_html_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_fast_path_agrees_with_the_float64_path(dtype):
    ref = torch.randn(37, 11, generator=torch.Generator().manual_seed(0)).to(dtype)
    run = (ref.double() * (1 + 1e-3 * torch.randn(37, 11, generator=torch.Generator().manual_seed(1)).double())
           ).to(dtype)
    run[0, 0], run[0, 1] = -ref[0, 0], 0.0     # a sign flip and a zero
    slow = tensor_errors(run, ref, 1e-4, 1e-3)
    fast = tensor_errors(run, ref, 1e-4, 1e-3, finite=True)
    assert fast["ulp"] == slow["ulp"] and fast["exact"] == slow["exact"] is False
    assert fast["max_abs_err"] == pytest.approx(slow["max_abs_err"], rel=1e-6)
    assert fast["frac_beyond"] == pytest.approx(slow["frac_beyond"], abs=2 / run.numel())
    assert fast["cosine"] == pytest.approx(slow["cosine"], abs=1e-5)
    assert fast["max_rel_err"] == pytest.approx(slow["max_rel_err"], rel=1e-5)
    same = tensor_errors(ref.clone(), ref, 0.0, 0.0, finite=True)
    assert same["exact"] and same["ulp"] == 0 and same["cosine"] == 1.0
