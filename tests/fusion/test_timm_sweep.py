"""scripts/timm_sweep.py on a stand-in ``timm`` (timm is not a dependency): one model per family, the smallest by
parameters counted on the meta device; arguments a family does not take are left out; a model that takes
``img_size`` yet fails at 64 px is run at its own size; and a fused model is compared with eager."""

from __future__ import annotations

import json
import runpy
import sys
import types
from pathlib import Path

import torch
from torch import nn

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "timm_sweep.py"


class Net(nn.Module):
    """Conv -> BN -> ReLU -> pool -> head; ``width`` sets its size, ``grid`` a side it insists on."""

    def __init__(self, width=4, num_classes=10, grid=None, drop_rate=0.0, **_):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        self.head, self.grid = nn.Linear(width, num_classes), grid
        self.pretrained_cfg = {"input_size": (3, 32, 32)}

    def forward(self, x):
        if self.grid is not None and x.shape[-1] != self.grid:
            raise RuntimeError(f"the size of tensor a ({x.shape[-1]}) must match the size of tensor b ({self.grid})")
        return self.head(self.act(self.bn(self.conv(x))).mean((2, 3)))


def _fake_timm(monkeypatch):
    def old_family(num_classes=10, drop_rate=0.0):  # no drop_path_rate, no img_size (older timm families)
        return Net(2, num_classes)

    def fixed_grid(num_classes=10, drop_rate=0.0, drop_path_rate=0.0, img_size=224):  # takes img_size, yet
        return Net(3, num_classes, grid=32)  # a window or a grid fixed elsewhere needs its own 32 px

    makers = {"net_small": lambda **kw: Net(2, **kw), "net_large": lambda **kw: Net(16, **kw),
              "old_family": old_family, "fixed_grid": fixed_grid}
    timm = types.ModuleType("timm")
    timm.list_models = lambda: list(makers)
    timm.create_model = lambda name, pretrained=False, **kw: makers[name](**kw)
    timm.models = types.ModuleType("timm.models")
    timm.models._registry = types.SimpleNamespace(_model_to_module={
        "net_small": "nets", "net_large": "nets", "old_family": "old", "fixed_grid": "grid"})
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "timm.models", timm.models)


def test_the_timm_sweep_takes_the_smallest_of_each_family_and_checks_it(tmp_path, monkeypatch, capsys):
    _fake_timm(monkeypatch)
    sweep = runpy.run_path(str(SCRIPT))
    assert sweep["smallest_per_family"]() == ["fixed_grid", "net_small", "old_family"]
    out = tmp_path / "timm.json"
    sweep["main"](["--models", "net_small,old_family,fixed_grid,no_such_model", "--out", str(out)])
    results = json.loads(out.read_text())
    for name in ("net_small", "old_family", "fixed_grid"):
        r = results[name]
        assert "error" not in r and r["fused"] == ["conv_bn_relu@module"], r
        assert r["bytes"] == r["plan_bytes"] and r["bytes"]["saved"] > 0, r  # the plan's figures are the step's
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
    assert results["no_such_model"]["error"].startswith("build: KeyError")
    sweep["main"](["--models", "net_small", "--dtype", "float32", "--autocast", "--out", str(out)])
    amp = json.loads(out.read_text())["net_small"]
    assert amp["amp_out_err"]["fused"] < 0.1 and amp["amp_grad_err"]["fused"] < 0.1, amp  # bf16 against fp32
    model, x = sweep["build"]("old_family", torch.float64)
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float64  # its own input size: no img_size taken
    assert "no_such_model" in capsys.readouterr().out
