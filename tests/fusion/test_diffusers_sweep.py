"""scripts/diffusers_sweep.py on a stand-in ``diffusers`` (diffusers is not a dependency): a DiT-shaped model with
what diffusers' blocks do that fx alone would stop at or fuse wrongly: a class-label dropout drawn with
``torch.rand``, ``if hidden_states.ndim == 4`` after the attention's dropout, and a GEGLU whose packed projection
activates its second half."""

from __future__ import annotations

import json
import runpy
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "diffusers_sweep.py"


class GEGLU(nn.Module):
    def __init__(self, dim, inner):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x):
        hidden, gate = self.proj(x).chunk(2, dim=-1)
        return hidden * F.gelu(gate)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1, self.attn_out, self.drop = nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Dropout(0.1)
        self.norm2 = nn.LayerNorm(dim)
        # the MLP's dropout at diffusers' default 0 (a fused op's mask is its own stream, not torch's draw)
        self.ff = nn.ModuleList([GEGLU(dim, 2 * dim), nn.Dropout(0.0), nn.Linear(2 * dim, dim)])

    def forward(self, x, emb):
        h = self.drop(self.attn_out(self.norm1(x) + emb[:, None])) + x
        if h.ndim == 4:
            h = h.squeeze(1)
        y = self.norm2(h)
        for module in self.ff:
            y = module(y)
        return y + h


class DiTTransformer2DModel(nn.Module):
    def __init__(self, in_channels=4, num_embeds_ada_norm=10, num_layers=2, **_):
        super().__init__()
        self.proj_in, self.labels = nn.Linear(in_channels, 16), nn.Embedding(num_embeds_ada_norm + 1, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(num_layers)])
        self.proj_out, self.num_classes = nn.Linear(16, in_channels), num_embeds_ada_norm

    def forward(self, hidden_states, timestep, class_labels):
        b, c, h, w = hidden_states.shape
        x = self.proj_in(hidden_states.flatten(2).transpose(1, 2))
        if self.training:  # the class dropped for classifier-free guidance, as diffusers' LabelEmbedding draws it
            drop = torch.rand(class_labels.shape[0], device=class_labels.device) < 0.1
            class_labels = torch.where(drop, self.num_classes, class_labels)
        emb = self.labels(class_labels) + timestep[:, None].to(x.dtype)
        for block in self.blocks:
            x = block(x, emb)
        return self.proj_out(x).transpose(1, 2).reshape(b, c, h, w)


def test_the_diffusers_sweep_fuses_a_dit_shaped_model_and_checks_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "diffusers", types.SimpleNamespace(DiTTransformer2DModel=DiTTransformer2DModel))
    sweep = runpy.run_path(str(SCRIPT))
    out = tmp_path / "diffusers.json"
    sweep["main"](["--models", "dit,no_such_model", "--out", str(out)])
    results = json.loads(out.read_text())
    r = results["dit"]
    assert "error" not in r and not r["rewrite_failed"] and r["bytes"] == r["plan_bytes"], r
    # the model traces whole, past the label dropout and the rank check; per block, the packed GEGLU (its second
    # half activated) with its dropout and down projection, and the residual add + LayerNorm
    assert r["fused"] == ["add_layer_norm@fx"] * 2 + ["gated_mlp_gelu@fx"] * 2, r["fused"]
    assert max(r[k] for k in ("out_err", "grad_err", "eval_err", "inference_err")) < 1e-12
    assert results["no_such_model"]["error"].startswith("build: KeyError")
    sweep["main"](["--list"])
    assert "unet2d_condition" in capsys.readouterr().out
    model, inputs = sweep["build"]("dit", torch.float64)
    assert model.training and inputs["hidden_states"].dtype == torch.float64
