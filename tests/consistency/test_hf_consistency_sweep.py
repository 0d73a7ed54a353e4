"""scripts/hf_consistency_sweep.py on two models: reproducible dropout, the checker on two identical steps, and the
fused model against the unfused one under the same seed."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hf_consistency_sweep.py"


def test_the_consistency_sweep_reports_each_model(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "consistency.json"
    main(["--models", "Bert,GPT2,NoSuchModel", "--out", str(out)])
    results = json.loads(out.read_text())
    for name in ("Bert", "GPT2"):
        r = results[name]
        assert "error" not in r and r["dropouts"] > 0 and r["fused"] > 0, r
        assert r["repeat_consistent"] and r["fused_repeat_equal"], r
        assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r  # the fused model draws the unfused one's masks
    assert results["NoSuchModel"]["error"].startswith("build: AttributeError")
    assert "NoSuchModel" in capsys.readouterr().out
