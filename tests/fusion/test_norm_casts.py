"""A norm written in Python that casts its parameters to its input's dtype (diffusers' FP32LayerNorm:
``F.layer_norm(x.float(), ..., weight.float(), bias.float())``, which Wan's blocks call on ``x.float()`` in a bf16
model), and a fused op failing on a chain's recorded inputs: each chain is fused or declined, never the whole model
stopped (``fuse`` raised "mixed dtype" for Wan in bf16 and float64)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsnn_lab as ol
from opsnn_lab import ops


class FP32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class Block(nn.Module):
    """Wan's use: the norm on ``h.float()``, its output cast back before the next Linear."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.out = nn.Linear(16, 16), FP32LayerNorm(16, 1e-6), nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        return self.out(self.norm(h.float()).type_as(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_norm_casting_its_parameters_is_planned_in_any_model_dtype(dtype):
    torch.manual_seed(0)
    model = Block().to(dtype).train()
    x = torch.randn(4, 16, dtype=dtype)
    fused, plan = ol.fusion.fuse(model, (x,))
    (d,) = [d for d in plan.decisions if d.pattern == "layer_norm"]
    # in float32 the cast back is no copy and the Linear reads the norm's output; else the cast's copy is what the
    # Linear keeps, so saving the output gains nothing
    assert d.fused == (dtype == torch.float32), d.reason
    torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)


def test_float64_parameters_of_a_float32_norm_are_cast_by_the_fused_op_and_get_their_gradients():
    """Parameters kept in float64 for a float32 stream: the op casts them at each call, as the module does, and their
    float64 gradients come back through the cast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), FP32LayerNorm(16), nn.Linear(16, 16)).train()
    model[1].double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-0.5, 0.5)
    x = torch.randn(6, 16)
    fused, plan = ol.fusion.fuse(model, (x,))
    (d,) = [d for d in plan.decisions if d.pattern == "layer_norm"]
    assert d.fused and d.params.get("cast_params") is True, d.reason
    assert "cast_params=True" in repr(ops.FusedLayerNorm(model[1].weight, model[1].bias, cast_params=True))
    grads = []
    for m in (model, fused):
        m.zero_grad(set_to_none=True)
        y = m(x)
        y.sin().sum().backward()
        grads.append((y, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    assert grads[1][1].keys() == grads[0][1].keys()
    for name, g in grads[0][1].items():
        assert grads[1][1][name].dtype == g.dtype, name
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-5, atol=1e-5, msg=name)


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


def test_a_norm_op_pickled_before_cast_params_loads_and_runs():
    torch.manual_seed(0)
    norm = nn.LayerNorm(8)
    op = ops.FusedLayerNorm.from_modules(norm)
    del op.__dict__["cast_params"]  # as a module saved before the option existed
    loaded = pickle.loads(pickle.dumps(op))
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded(x), norm(x))
    assert "cast_params" not in repr(loaded)
