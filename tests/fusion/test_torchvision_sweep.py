"""scripts/torchvision_sweep.py on a stand-in ``torchvision`` (not a dependency): the classification models up to
the size limit, counted on the meta device; random steps a constructor takes set to 0 and the ones it does not
take left out; a model that fails at 64 px run at its own crop size (224 where it names none); a video model fed
clips; a fused model compared with eager."""

from __future__ import annotations

import json
import runpy
import sys
import types
from pathlib import Path

import torch
from torch import nn

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "torchvision_sweep.py"


class Net(nn.Module):
    """Conv -> BN -> ReLU -> pool -> dropout -> head; ``grid``: a side it insists on (a ViT's)."""

    def __init__(self, width=4, num_classes=10, dropout=0.5, grid=None):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        self.drop, self.head, self.grid = nn.Dropout(dropout), nn.Linear(width, num_classes), grid

    def forward(self, x):
        if self.grid is not None and x.shape[-1] != self.grid:
            raise ValueError(f"Wrong image width! Expected {self.grid} but got {x.shape[-1]}!")
        return self.head(self.drop(self.act(self.bn(self.conv(x))).mean((2, 3))))


class Clip(nn.Module):
    """A video ResNet's stem: Conv3d -> BatchNorm3d -> ReLU -> pool -> head."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv3d(3, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))).mean((2, 3, 4)))


def _fake_torchvision(monkeypatch, made, video=False):
    def net(num_classes=10, dropout=0.5):
        made.append(dropout)
        return Net(3, num_classes, dropout)

    def no_dropout(num_classes=10):  # takes none of the random steps
        return Net(2, num_classes, 0.0)

    makers = {"net": net, "no_dropout": no_dropout, "huge": lambda num_classes=10: Net(5000, num_classes, 0.0),
              "fixed_grid": lambda num_classes=10, dropout=0.5: Net(2, num_classes, dropout, grid=224)}
    tv = types.ModuleType("torchvision")
    tv.models = types.ModuleType("torchvision.models")
    tv.models.list_models = lambda module=None: list(makers)
    tv.models.get_model = lambda name, weights=None, **kw: makers[name](**kw)
    tv.models.get_model_weights = lambda name: {}[name]  # no weights registered: 224
    if video:
        tv.models.video = types.ModuleType("torchvision.models.video")
        makers["clip"] = Clip
        tv.models.list_models = lambda module=None: ["clip"] if module is tv.models.video else list(makers)[:-1]
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", tv.models)


def test_the_torchvision_sweep_takes_every_model_under_the_limit_and_checks_it(tmp_path, monkeypatch, capsys):
    made = []
    _fake_torchvision(monkeypatch, made)
    sweep = runpy.run_path(str(SCRIPT))
    monkeypatch.setitem(sweep["classification_models"].__globals__, "MAX_PARAMETERS", 100_000)
    assert sweep["classification_models"]() == ["net", "no_dropout", "fixed_grid"]  # huge: 135k parameters
    out = tmp_path / "tv.json"
    sweep["main"](["--models", "net,no_dropout,fixed_grid,no_such_model", "--out", str(out)])
    results = json.loads(out.read_text())
    assert set(made) == {0.0}  # every dropout the constructor takes at 0, so eager and fused draw nothing
    for name in ("net", "no_dropout", "fixed_grid"):
        r = results[name]
        assert "error" not in r and r["fused"] == ["conv_bn_relu@module"], r
        assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
    assert results["no_such_model"]["error"].startswith("build: KeyError")
    model, x = sweep["build"]("fixed_grid", torch.float32, small=False)
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32
    assert "no_such_model" in capsys.readouterr().out


def test_video_models_take_clips(tmp_path, monkeypatch):
    _fake_torchvision(monkeypatch, [], video=True)
    sweep = runpy.run_path(str(SCRIPT))
    monkeypatch.setitem(sweep["classification_models"].__globals__, "MAX_PARAMETERS", 100_000)
    assert sweep["classification_models"]() == ["net", "no_dropout", "fixed_grid", "clip"]
    out = tmp_path / "tv.json"
    sweep["main"](["--models", "clip", "--out", str(out)])
    r = json.loads(out.read_text())["clip"]
    assert "error" not in r and r["fused"] == ["conv_bn_relu@module"], r  # the Conv3d chain
    assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
    assert sweep["build"]("clip", torch.float32)[1].shape == (2, 3, 8, 64, 64)
    assert sweep["build"]("clip", torch.float32, small=False)[1].shape == (2, 3, 16, 224, 224)
