"""The fusion benchmark runs end to end on tiny shapes and writes its JSON (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from opsnn_lab.bench import fusion


@pytest.mark.slow
def test_fusion_bench_small(tmp_path, capsys):
    assert fusion.main(["--layers", "1", "--batch", "1", "--seq", "8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fusion.json").read_text())
    bert, resnet = data["rows"]
    assert bert["summary"] == {"linear_gelu_dropout_linear": {"fused": 1, "rejected": 0},
                               "attention": {"fused": 1, "rejected": 0}, "qkv": {"fused": 1, "rejected": 0}}
    assert bert["estimate rel err"] <= 0.1 and resnet["estimate rel err"] <= 0.1
    assert 0 < bert["activation ratio"] < 1
    assert "BERT-base analysis" in capsys.readouterr().out
