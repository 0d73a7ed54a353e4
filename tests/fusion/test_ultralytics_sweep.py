"""scripts/ultralytics_sweep.py on a stand-in ``ultralytics`` (Ultralytics is not a dependency): every configuration
file is named at its first scale as Ultralytics reads it back, a P6 head gets an input its stride takes, RT-DETR's
configurations build through ``RTDETR``, and each model's training outputs (a dict of boxes and scores) and every
gradient are compared with eager, with the plan's bytes against the step's."""

from __future__ import annotations

import json
import runpy
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("yaml")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ultralytics_sweep.py"
CONFIGS = {  # path under cfg/models -> its text
    "v8/yolov8.yaml": "nc: 80\nscales:\n  n: [0.33, 0.25, 1024]\n  s: [0.33, 0.50, 1024]\nbackbone: []\n",
    "v8/yolov8-p6.yaml": "scales:\n  n: [0.33, 0.25, 1024]\n",
    "v8/yoloe-v8-seg.yaml": "scales:\n  s: [0.33, 0.50, 1024]\n",
    "v10/yolov10n.yaml": "scales:\n  n: [0.33, 0.25, 1024]\n",  # one file per scale: named as it is
    "rt-detr/rtdetr-l.yaml": "nc: 80\nbackbone: []\n",  # no scales
}


class Detector(nn.Module):
    """Conv -> BN -> SiLU twice (Ultralytics' ``Conv``), a box and a score head; training output: a dict."""

    def __init__(self, stride: int = 32, width: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.SiLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.SiLU())
        self.boxes, self.scores = nn.Conv2d(width, 4, 1), nn.Conv2d(width, 2, 1)
        self.stride = torch.tensor([8.0, 16.0, float(stride)])

    def forward(self, x):
        if x.shape[-1] < 2 * int(self.stride.max()):
            raise RuntimeError(f"input {x.shape[-1]} px below the head's stride {int(self.stride.max())}")
        h = self.block(self.stem(x))
        return {"boxes": self.boxes(h).flatten(2), "scores": self.scores(h).flatten(2)}


def _stand_in(monkeypatch, tmp_path):
    root = tmp_path / "ultralytics"
    for rel, text in CONFIGS.items():
        (root / "cfg" / "models" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "cfg" / "models" / rel).write_text(text)
    built = []

    def maker(kind):
        def make(name):
            if not name.endswith(".yaml"):
                raise FileNotFoundError(name)
            built.append((kind, name))
            return types.SimpleNamespace(model=Detector(stride=64 if "-p6" in name else 32).requires_grad_(False))
        return make

    ultralytics = types.ModuleType("ultralytics")
    ultralytics.__file__ = str(root / "__init__.py")
    ultralytics.YOLO, ultralytics.RTDETR = maker("YOLO"), maker("RTDETR")
    monkeypatch.setitem(sys.modules, "ultralytics", ultralytics)
    return built


def test_the_sweep_names_each_configuration_at_its_first_scale_and_checks_it(tmp_path, monkeypatch, capsys):
    built = _stand_in(monkeypatch, tmp_path)
    sweep = runpy.run_path(str(SCRIPT))
    names = sweep["configurations"]()
    assert names == ["rtdetr-l.yaml", "yolov10n.yaml", "yoloe-v8s-seg.yaml", "yolov8n-p6.yaml", "yolov8n.yaml"]
    out = tmp_path / "ul.json"
    sweep["main"](["--models", "yolov8n.yaml,yolov8n-p6.yaml,rtdetr-l.yaml,no_such_model", "--out", str(out)])
    results = json.loads(out.read_text())
    for name in ("yolov8n.yaml", "yolov8n-p6.yaml", "rtdetr-l.yaml"):
        r = results[name]
        assert "error" not in r and r["fused"] == ["conv_bn_silu@module"] * 2, r
        assert r["bytes"] == r["plan_bytes"] and r["bytes"]["saved"] > 0, r  # the plan's figures are the step's
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
    assert ("RTDETR", "rtdetr-l.yaml") in built and ("YOLO", "yolov8n.yaml") in built
    assert results["no_such_model"]["error"].startswith("build: FileNotFoundError")
    model, x = sweep["build"]("yolov8n-p6.yaml", torch.float64)
    assert x.shape == (2, 3, 128, 128) and x.dtype == torch.float64  # twice the P6 head's stride
    assert all(p.requires_grad for p in model.parameters()) and model.training
    assert "no_such_model" in capsys.readouterr().out
