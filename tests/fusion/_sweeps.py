"""A sweep of ``scripts/`` run from a test on a few models: its records, each checked clean."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
ERRORS = ("out_err", "grad_err", "eval_err", "inference_err")


def sweep(script: str) -> dict:
    """The script's globals (its ``main`` and model lists), run as a file as the command line runs it."""
    return runpy.run_path(str(SCRIPTS / script))


def clean_records(script: str, names: list[str], tmp_path, tol: float = 1e-10) -> dict:
    """``script``'s records for ``names``: each model fused something, nothing failed, ran unfused or failed its
    rewrite, and every output and gradient is within ``tol`` of eager."""
    out = tmp_path / "sweep.json"
    sweep(script)["main"](["--models", ",".join(names), "--out", str(out)])
    results = json.loads(out.read_text())
    for name in names:
        r = results[name]
        assert "error" not in r and r["fused"] and r["rewrite_failed"] == [] and "ran_unfused" not in r, r
        assert max(r[k] for k in ERRORS) < tol, r
    return results
