"""A forward may compute something and drop it with its graph (RT-DETR's decoder refines its boxes once more after
the last layer and reads the result only through ``detach``; a recurrent model keeps a state only detached): what
that computation saved is freed before backward. The step's figure leaves it out, every run alike, and so does the
plan (a chain inside it saves nothing, fused or not), so the plan's figures are the step's; a state kept with its
graph in an attribute is held, and counted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opsnn_lab as ol
from opsnn_lab.measuring import activation_bytes
from tests.fusion._reproducible import assert_trains_as_eager


def _mlp(d: int = 16):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class _Refine(nn.Module):
    """Layers that each refine a box from the last one; the box of the last layer is only kept detached.
    ``keep_graph``: the last box is kept in an attribute with its graph (a recurrent state): then it is held."""

    def __init__(self, keep_graph: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_mlp() for _ in range(3))
        self.box = nn.ModuleList(_mlp() for _ in range(3))
        self.keep_graph = keep_graph
        self.state = None

    def forward(self, x):
        boxes, refined = [], None
        for layer, box in zip(self.layers, self.box):
            x = x + layer(x)
            if refined is not None:
                boxes.append(refined)
            refined = torch.sigmoid(box(x))  # sigmoid keeps its output; the last one is dropped with its graph
        self.state = refined if self.keep_graph else refined.detach()
        return x + torch.stack(boxes).sum(0)


def _figures(model, fused, x):
    run = lambda m: m(x).sum()  # noqa: E731
    eager = activation_bytes(lambda: run(model), exclude=tuple(model.parameters()))
    return eager, eager - activation_bytes(lambda: run(fused), exclude=tuple(fused.parameters()))


@pytest.mark.parametrize("keep_graph", [False, True], ids=["dropped", "kept-in-an-attribute"])
def test_what_a_dropped_computation_saves_is_in_neither_the_plan_nor_the_step(keep_graph):
    torch.manual_seed(0)
    model = _Refine(keep_graph).double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    mlps = [d for d in plan.decisions if d.pattern == "linear_gelu_linear"]
    assert len(mlps) == 6 and all(d.fused for d in mlps), plan.summary()
    dropped = [d for d in mlps if "drops its result" in d.reason]
    if keep_graph:
        assert dropped == []
    else:  # the last box head: saves nothing across the step, fused or not
        assert [d.modules[0] for d in dropped] == ["box.2.0"] and dropped[0].saved_bytes == 0
    eager, saved = _figures(model, fused, x)
    # the last box's head: 2 x 5 x (16 + 64 + 64) doubles for the MLP, 2 x 5 x 16 for the sigmoid's output
    held = 2 * 5 * (16 + 64 + 64 + 16) * 8
    assert eager == _figures(model, model, x)[0]  # every run alike
    assert plan.activation_bytes == eager and plan.saved_bytes == saved > 0
    model.keep_graph = False
    assert _figures(model, model, x)[0] == eager - (0 if not keep_graph else held)
    model.keep_graph = keep_graph
    assert_trains_as_eager(model, fused, x)


class _Unbound(nn.Module):
    """Views ``unbind`` returned, read, then their base written in place (CogView4's rotary embedding): autograd
    refuses to give those views an autograd node again, and reading one raised in the analysis."""

    def __init__(self):
        super().__init__()
        self.mlp, self.pair = _mlp(), nn.Linear(16, 2)

    def forward(self, x):
        h = self.pair(x)
        first, second = h.unbind(-1)
        out = self.mlp(x) * (first + second).unsqueeze(-1)
        h.mul_(2.0)
        return out + h.sum(-1, keepdim=True)


class _Checked(nn.Module):
    """An MLP whose output is checked with ``torch.isfinite`` (RT-DETR's encoder layers in training): that call takes
    ``x.abs()`` inside and saves ``x`` for a backward nothing can reach, its result being boolean."""

    def __init__(self):
        super().__init__()
        self.mlp = _mlp()

    def forward(self, x):
        h = x + self.mlp(x)
        if not torch.isfinite(h).all():
            h = h.nan_to_num()
        return h * 2.0  # nothing else keeps h


@pytest.mark.parametrize("make", [_Unbound, _Checked], ids=["unbind-views-rewritten", "isfinite"])
def test_the_plan_is_the_step_where_autograd_keeps_odd_nodes(make):
    # _Unbound: reading those views' autograd node raised in the analysis; _Checked: the plan counted isfinite's save
    torch.manual_seed(0)
    model = make().double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    fused, plan = ol.fusion.fuse(copy.deepcopy(model), (x,))
    assert [d.pattern for d in plan.fused] == ["linear_gelu_linear"]
    eager, saved = _figures(model, fused, x)
    assert plan.activation_bytes == eager and plan.saved_bytes == saved > 0
    assert_trains_as_eager(model, fused, x)
