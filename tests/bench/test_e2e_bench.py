"""The e2e benchmark runs CI-sized: every column present, the seed's invariants hold."""

from __future__ import annotations

import json

import pytest

from opsnn_lab.bench import e2e

pytestmark = pytest.mark.slow


def test_quick_e2e(tmp_path):
    assert e2e.main(["--quick", "--variants", "eager,opsnn-strict", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "e2e.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "opsnn-strict"}
    strict = rows["opsnn-strict"]
    assert strict["runs_bit_identical"], "two strict runs with one seed must agree bit for bit"
    assert strict["nan_steps"] == 0
    assert strict["activation_ratio"] < 1.0, "fusion must save activation memory"
    assert abs(strict["loss_vs_eager"]) < 0.02
    assert (tmp_path / "e2e.md").read_text().startswith("# e2e (quick")


def test_rejects_unknown_variant():
    with pytest.raises(SystemExit):
        e2e.main(["--variants", "eager,turbo"])
