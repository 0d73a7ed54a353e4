"""Where fx can rewrite: autowrapped helpers, specialised arguments, the dataflow graph it yields."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.fusion.regions import concrete_args, find_regions, fx_graph, trace_region
from opsnn_lab.fusion.runtime import trace_runtime
from opsnn_lab.models import EncoderConfig, EncoderLayer, ResNet
from opsnn_lab.testing import seeded


def test_a_helper_that_stops_the_tracer_is_kept_as_a_call():
    gm, wrapped = trace_region(ResNet(), {}, True)
    assert [f.__name__ for f in wrapped] == ["check_tensor"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "check_tensor"]
    assert len(calls) == 1  # it still validates real tensors in the rewritten model


def test_observed_non_tensor_arguments_are_specialised():
    layer = EncoderLayer(EncoderConfig.tiny())
    assert concrete_args(layer, ((seeded(1, 4, 64),), {})) == {"mask": None}
    assert concrete_args(layer, ((seeded(1, 4, 64), seeded(1, 1, 1, 4)), {})) == {}


def test_trace_region_restores_mode_flags():
    layer = EncoderLayer(EncoderConfig.tiny()).eval()
    trace_region(layer, {"mask": None}, True)
    assert not any(m.training for m in layer.modules())


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.out(self.inner(x))


def test_untraceable_module_descends_to_children():
    model = Branchy()
    trace = trace_runtime(model, (seeded(2, 4),))
    regions = {r.path: r for r in find_regions(model, trace.calls)}
    assert regions[""].route == "untraceable" and "control flow" in regions[""].reason
    assert regions["inner"].route == "container"  # tried, and it traces, but it is an nn.Sequential: see below
    assert "out" not in regions  # a leaf module needs no tracing


def test_fx_graph_speaks_the_same_op_names_as_the_run():
    class M(nn.Module):
        def forward(self, x):
            b, t = x.shape
            return torch.softmax(F.gelu(x).view(b, t) * (1.0 / t), dim=-1)

    gm, _ = trace_region(M(), {}, True)
    g = fx_graph(gm, "blk")
    ops = [n.op for n in g.nodes if n.kind == "function"]
    assert ops == ["gelu", "view", "mul", "softmax"]  # shape arithmetic is not part of the dataflow
    run = trace_runtime(M(), (seeded(2, 3),)).graph
    assert [n.op for n in run.nodes if n.kind == "function"] == ops


def test_a_module_that_runs_its_children_in_turn_is_a_container_not_a_region():
    class Steps(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), Branchy().inner

        def forward(self, x):
            for step in self.children():
                x = step(x)
            return x

    for model in (Steps(), nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU()))):
        names = [n for n, _ in model.named_modules()]
        trace = trace_runtime(model, (seeded(2, 4),))
        regions = {r.path: r for r in find_regions(model, trace.calls)}
        assert regions[""].route == "container" and "would become one more step" in regions[""].reason
        assert regions["b" if isinstance(model, Steps) else "1"].route == "container"  # an inner nn.Sequential
        assert [n for n, _ in model.named_modules()] == names  # the probe's extra child is gone
    model = EncoderLayer(EncoderConfig.tiny())  # calls its children, but not by iterating them: a region
    trace = trace_runtime(model, (seeded(1, 4, 64),))
    assert find_regions(model, trace.calls)[0].route == "fx"
