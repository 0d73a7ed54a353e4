"""The fusion benchmark runs end to end on tiny shapes and writes its JSON (no timing assertions)."""

from __future__ import annotations

import json
import sys

import pytest

from opsnn_lab.bench import fusion


@pytest.mark.slow
def test_fusion_bench_small(tmp_path, capsys):
    assert fusion.main(["--layers", "1", "--batch", "1", "--seq", "8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fusion.json").read_text())
    bert, resnet = data["rows"]
    assert bert["summary"] == {"linear_gelu_dropout_linear": {"fused": 1, "rejected": 0},
                               "attention": {"fused": 1, "rejected": 0}, "qkv": {"fused": 1, "rejected": 0},
                               "add_layer_norm": {"fused": 2, "rejected": 1}, "layer_norm": {"fused": 0, "rejected": 3}}
    assert bert["estimate rel err"] <= 0.1 and resnet["estimate rel err"] <= 0.1
    assert 0 < bert["activation ratio"] < 1
    assert "BERT-base analysis" in capsys.readouterr().out


@pytest.mark.slow
def test_fusion_bench_hf_matrix(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert fusion.main(["--models", "hf", "--no-base", "--no-lm", "--out", str(tmp_path)]) == 0
    rows = {r["model"]: r for r in json.loads((tmp_path / "fusion_hf.json").read_text())["rows"]}
    assert set(rows) >= {"bert", "roberta", "gpt2", "llama", "t5", "resnet", "efficientnet", "mobilenet_v2", "convnext",
                         "encoder", "cnn"}
    for r in rows.values():
        assert r["fused"] + r["rejected"] == r["candidates"] and 0 < r["activation fused/eager"] <= 1
        assert 0 < r["bf16 autocast fused/eager"] <= 1
    for name in ("gpt2", "llama", "t5", "efficientnet", "mobilenet_v2"):  # autocast keeps the memory win
        assert rows[name]["bf16 autocast fused/eager"] < 0.85, name
    assert rows["llama"]["summary"]["gated_mlp_silu"] == {"fused": 2, "rejected": 0}
    assert rows["t5"]["summary"]["gated_mlp_gelu_tanh"] == {"fused": 4, "rejected": 0}
    assert rows["phi3"]["summary"]["gated_mlp_silu"] == {"fused": 2, "rejected": 0}  # one packed gate_up Linear
    assert rows["falcon"]["summary"]["linear_gelu_linear"] == {"fused": 2, "rejected": 0}  # FalconLinear
    assert rows["bloom"]["summary"]["linear_gelu_tanh_linear"] == {"fused": 2, "rejected": 0}  # BloomGelu
    out = capsys.readouterr().out
    assert "activation fused/eager" in out and "EfficientNet activation bytes fused/eager" in out


def test_fusion_bench_timm_says_clearly_when_timm_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    assert fusion.main(["--models", "timm", "--out", str(tmp_path)]) == 2
    assert "pip install timm" in capsys.readouterr().out
    assert not (tmp_path / "fusion_timm.json").exists()


@pytest.mark.slow
def test_fusion_bench_timm(tmp_path, monkeypatch):
    pytest.importorskip("timm")  # not a dependency: runs where timm is installed
    from opsnn_lab.demos import zoo

    monkeypatch.setattr(zoo, "TIMM_MODELS", ("mobilenetv2_050", "resnet18"))
    assert fusion.main(["--models", "timm", "--out", str(tmp_path)]) == 0
    rows = {r["model"]: r for r in json.loads((tmp_path / "fusion_timm.json").read_text())["rows"]}
    assert rows["mobilenetv2_050"]["summary"]["conv_bn_relu6"] == {"fused": 35, "rejected": 0}  # BatchNormAct2d
    assert rows["resnet18"]["summary"]["conv_bn_relu"]["fused"] == 8  # past drop_block (Identity)
    assert all(0 < r["activation fused/eager"] < 1 for r in rows.values())
