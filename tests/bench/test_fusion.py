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
                               "add_layer_norm": {"fused": 2, "rejected": 1}, "layer_norm": {"fused": 0, "rejected": 3},
                               "dropout_linear": {"fused": 0, "rejected": 1}}  # the MLP row takes its dropout
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
    assert rows["mixtral"]["summary"]["gated_product_silu"] == {"fused": 2, "rejected": 0}  # the experts' product
    assert rows["mixtral"]["activation fused/eager"] < 0.8  # 0.850 before the experts' forward was traced
    assert rows["falcon"]["summary"]["linear_gelu_linear"] == {"fused": 2, "rejected": 0}  # FalconLinear
    assert rows["bloom"]["summary"]["linear_gelu_tanh_linear"] == {"fused": 2, "rejected": 0}  # BloomGelu
    out = capsys.readouterr().out
    assert "activation fused/eager" in out and "EfficientNet activation bytes fused/eager" in out


@pytest.mark.parametrize("library, hint", [("timm", "pip install timm"), ("torchvision", "built for your torch"),
                                           ("peft", "pip install peft")])
def test_fusion_bench_says_clearly_when_a_model_library_is_missing(tmp_path, capsys, monkeypatch, library, hint):
    monkeypatch.setitem(sys.modules, library, None)  # import raises ImportError
    assert fusion.main(["--models", library, "--out", str(tmp_path)]) == 2
    assert f"--models {library} needs {library}" in capsys.readouterr().out
    assert not (tmp_path / f"fusion_{library}.json").exists()


def test_fusion_bench_torchvision_rows_from_the_library_builder(tmp_path, capsys, monkeypatch):
    """The torchvision rows with a stand-in library (torchvision is not a dependency): the builder is asked for
    each listed model without weights and 10 classes, and each row holds its plan and measured ratio."""
    import types

    from torch import nn

    from opsnn_lab.demos import zoo

    asked = []

    def get_model(name, weights, num_classes, **extra):
        asked.append((name, weights, num_classes, extra))
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Hardswish(), nn.Conv2d(8, num_classes, 1))

    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(get_model=get_model)
    fake.__version__ = "0.0-test"
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setattr(zoo, "TORCHVISION_MODELS", ("mobilenet_v3_small", "googlenet"))
    assert fusion.main(["--models", "torchvision", "--out", str(tmp_path)]) == 0
    assert asked == [("mobilenet_v3_small", None, 10, {}),
                     ("googlenet", None, 10, {"aux_logits": False, "init_weights": True})]
    data = json.loads((tmp_path / "fusion_torchvision.json").read_text())
    assert data["torchvision"] == "0.0-test"
    for row in data["rows"]:
        assert row["summary"] == {"conv_bn_hardswish": {"fused": 1, "rejected": 0}}
        assert 0 < row["activation fused/eager"] < 1
    assert "mobilenet_v3_small" in capsys.readouterr().out


def test_fusion_bench_peft_rows(tmp_path, monkeypatch):
    """LoRA rows (peft is a dev dependency): every adapter's dropout and every gated product fuse."""
    pytest.importorskip("peft")
    import functools

    from opsnn_lab.demos import zoo

    monkeypatch.setattr(zoo, "PEFT_MODELS", ("lora_llama", "lora_llama_dropout"))
    monkeypatch.setattr(zoo, "build_peft", functools.partial(zoo.build_peft, seq=16))
    assert fusion.main(["--models", "peft", "--out", str(tmp_path)]) == 0
    rows = {r["model"]: r for r in json.loads((tmp_path / "fusion_peft.json").read_text())["rows"]}
    plain, dropped = rows["lora_llama"]["summary"], rows["lora_llama_dropout"]["summary"]
    assert plain["gated_product_silu"] == dropped["gated_product_silu"] == {"fused": 4, "rejected": 0}
    assert "dropout_linear" not in plain and dropped["dropout_linear"] == {"fused": 28, "rejected": 0}  # 7 a layer
    assert rows["lora_llama_dropout"]["activation fused/eager"] < rows["lora_llama"]["activation fused/eager"] < 1


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
