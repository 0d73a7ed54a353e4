"""Every public name the design fixes exists, under the seed-compatible spellings too."""

from __future__ import annotations

import importlib

import pytest

import opsnn_lab as ol

DESIGN_NAMES = [
    "fusion.analyze", "fusion.apply", "fusion.fuse", "fusion.FusionPlan", "fusion.Decision",
    "ops.FusedLinearGELUDropout", "ops.FusedConvBNReLU", "ops.FusedQKV",
    "precision.LocalScaler", "precision.DynamicScaler", "precision.MasterWeightOptimizer",
    "precision.fp16_allreduce_hook", "precision.GradientStats",
    "consistency.SeedPool", "consistency.make_reproducible", "consistency.strict",
    "memory.MemoryPool", "bench.activation_bytes", "record", "train",
    "widgets.FusionExplorer", "widgets.GradientHistogram", "widgets.ScalerTuner", "widgets.DivergenceViewer",
]


@pytest.mark.parametrize("dotted", DESIGN_NAMES)
def test_design_name_exists(dotted):
    obj = ol
    for part in dotted.split("."):
        obj = getattr(obj, part)
    assert obj is not None


def test_seed_import_path():
    from opsnn_lab.debug import ConsistencyChecker

    assert ConsistencyChecker is ol.consistency.ConsistencyChecker


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ol.nope  # noqa: B018
    with pytest.raises(AttributeError):
        importlib.import_module("opsnn_lab.ops").nope  # noqa: B018


def test_import_is_cheap():
    # importing the package must not import the pillars (notebooks import it first thing)
    import subprocess
    import sys

    code = "import sys, opsnn_lab; print(sorted(m for m in sys.modules if m.startswith('opsnn_lab.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "opsnn_lab.fusion" not in out and "opsnn_lab.precision" not in out
