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


@pytest.mark.slow
def test_fusion_bench_hf_matrix(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert fusion.main(["--models", "hf", "--no-base", "--out", str(tmp_path)]) == 0
    rows = {r["model"]: r for r in json.loads((tmp_path / "fusion_hf.json").read_text())["rows"]}
    assert set(rows) >= {"bert", "roberta", "gpt2", "llama", "resnet", "efficientnet", "convnext", "encoder", "cnn"}
    for r in rows.values():
        assert r["fused"] + r["rejected"] == r["candidates"] and 0 < r["activation fused/eager"] <= 1
    assert rows["bert"]["fused"] == rows["bert"]["candidates"]
    assert "activation fused/eager" in capsys.readouterr().out
