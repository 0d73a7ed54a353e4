"""A norm written in Python that casts its parameters to its input's dtype (diffusers' FP32LayerNorm:
``F.layer_norm(x.float(), ..., weight.float(), bias.float())``, which Wan's blocks call on ``x.float()`` in a bf16
model), and a fused op failing on a chain's recorded inputs: each chain is fused or declined, never the whole model
stopped (``fuse`` raised "mixed dtype" for Wan in bf16 and float64)."""

from __future__ import annotations

import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab import ops


def test_a_fused_op_failing_on_the_recorded_inputs_declines_its_chain_not_the_model(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16), nn.Linear(16, 4)).train()
    x = torch.randn(4, 16)

    def fails(self, *args):
        raise RuntimeError("an input this op cannot take\nsecond line")

    monkeypatch.setattr(ops.FusedLayerNorm, "forward", fails)
    fused, plan = ol.fusion.fuse(model, (x,))
    monkeypatch.undo()
    by = {d.pattern: d for d in plan.decisions}
    assert not by["layer_norm"].fused
    assert ("the fused op failed on the chain's recorded inputs (RuntimeError: an input this op cannot take); it runs "
            "unfused") in by["layer_norm"].reason
    assert by["linear_gelu_linear"].fused  # the other chains are planned as before
    torch.testing.assert_close(fused(x), model(x))
