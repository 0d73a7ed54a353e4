"""A model's own autocast block (``with torch.autocast(..., enabled=False)`` around a float32 computation: rotary
tables, a router's softmax) inside a region fx traces whole: the traced code enters and leaves it where the model's
code does, so under the caller's autocast the fused model computes what the model does (fx recorded no such block,
and the block ran in bf16: 5.9e-3 off)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import opsnn_lab as ol


class _Float32Projection(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            t = self.proj(x.float())  # float32 whatever the caller's autocast
        h = x + t
        return h + self.fc2(self.act(self.fc1(self.norm(h))))


def _step(m, x):
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    out.float().square().sum().backward()
    return out.detach(), [p.grad for p in m.parameters()]


def test_a_models_autocast_block_runs_as_it_does_in_the_model():
    torch.manual_seed(0)
    model = _Float32Projection().train()
    x = torch.randn(2, 5, 16)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert any(d.route == "fx:<model>" for d in plan.fused), [d.route for d in plan.fused]  # traced whole
    (out_a, grads_a), (out_b, grads_b) = _step(model, x), _step(fused, x)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)  # the bf16 ops are eager's; the block's float32 too
    for (name, _), a, b in zip(model.named_parameters(), grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3, msg=name)
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
