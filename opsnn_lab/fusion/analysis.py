"""``analyze``: trace at run time, find candidates, check where fx can rewrite them, cost them."""

from __future__ import annotations

import time

import torch
from torch import nn

from opsnn_lab._checks import check_type
from opsnn_lab.fusion.cost import CostModel
from opsnn_lab.fusion.patterns import FAMILIES, Match, find_all, pattern_of
from opsnn_lab.fusion.plan import Decision, FusionPlan
from opsnn_lab.fusion.regions import Region, find_regions
from opsnn_lab.fusion.runtime import RuntimeTrace, trace_runtime

__all__ = ["analyze", "Analysis", "split_inputs", "check_patterns"]


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tensor, a tuple/list of positional arguments, or a dict of keyword arguments."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError("example_inputs must be a Tensor, a tuple of positional arguments or a dict of keyword "
                    f"arguments, got {type(example_inputs).__name__}")


def check_patterns(patterns) -> list[str] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"patterns must be a list of pattern names, got {patterns!r}")
    known = {*FAMILIES, "conv_bn_relu_maxpool", "linear_gelu_dropout_linear"}
    bad = [p for p in patterns if p not in known]
    if bad:
        raise ValueError(f"patterns has unknown names {bad}; choose from {sorted(known)}")
    return list(patterns)


class Analysis:
    """Everything one trace found; ``plan(patterns)`` turns it into decisions without tracing again."""

    def __init__(self, model: nn.Module, trace: RuntimeTrace, regions: list[Region], name: str):
        self.model, self.trace, self.regions, self.name = model, trace, regions, name
        self.cost = CostModel(trace, lambda m: pattern_of(m.pattern).build(m))
        self.rewritable: dict[tuple, str] = {}  # match key -> region path
        for r in regions:
            if r.route == "fx":
                for m in find_all(r.graph):
                    if m.viable:
                        self.rewritable[m.key] = r.path
        self.costs: dict[tuple, tuple[int, int]] = {}
        for m in find_all(trace.graph):
            if m.viable and m.key in self.rewritable:
                self.costs[m.key] = (self.cost.saved_bytes(m), self.cost.traffic_bytes(m))
        self.trace.tensors.clear()  # activations (and the autograd graph holding them) are no longer needed
        self.trace.output = None

    def _not_rewritable(self, m: Match) -> str:
        first = m.modules[0] if m.modules else ""
        blockers = [r for r in self.regions if r.route != "fx" and (first + ".").startswith(r.path + "." if r.path
                                                                                            else "")]
        if blockers:
            r = max(blockers, key=lambda r: len(r.path))
            return (f"cannot be rewritten: `{r.path or type(self.model).__name__}` is not traceable by torch.fx "
                    f"({r.reason}) and no traceable submodule contains the whole chain")
        return "cannot be rewritten: torch.fx sees a different graph around this chain than the run-time trace"

    def decision(self, m: Match) -> Decision:
        d = Decision(m.pattern, m.modules, m.ok, m.reason, chain=[n.label for n in m.nodes],
                     nodes=[n.name for n in m.nodes],
                     shapes=[n.shape for n in m.nodes],
                     params={k: v for k, v in m.params.items() if isinstance(v, (int, float, str, bool))})
        if m.ok and m.key not in self.rewritable:
            d.fused, d.reason = False, self._not_rewritable(m)
        elif m.ok:
            d.route = f"fx:{self.rewritable[m.key] or '<model>'}"
            d.saved_bytes, d.traffic_bytes = self.costs[m.key]
        return d

    def plan(self, patterns=None) -> FusionPlan:
        patterns = check_patterns(patterns)
        with torch.random.fork_rng(devices=[]):  # ops may draw a dropout seed when built to validate a chain
            decisions = [self.decision(m) for m in find_all(self.trace.graph, patterns)]
        total = sum(dict((k, b) for _, k, b in self.trace.saved).values())
        return FusionPlan(decisions, [r.to_dict() for r in self.regions], total, patterns, self.name,
                          graph=graph_data(self.trace), _analysis=self)


def graph_data(trace: RuntimeTrace) -> dict:
    """Nodes (module name or op, type, scope, shape) and edges of the trace, for views."""
    nodes = [{"name": n.name, "label": n.label, "op": n.op, "kind": n.kind, "scope": n.scope,
              "type": type(n.obj).__name__ if n.obj is not None else n.op, "shape": n.shape}
             for n in trace.graph.nodes]
    edges = [[i, n.name] for n in trace.graph.nodes for i in dict.fromkeys(n.inputs)]
    return {"nodes": nodes, "edges": edges}


def analyze(model: nn.Module, example_inputs, patterns=None) -> FusionPlan:
    """Trace ``model`` on ``example_inputs`` (one forward in train mode) and decide every candidate.

    The model's mode flags, its buffers and the global RNG are left as they were.
    """
    check_type("model", model, nn.Module)
    args, kwargs = split_inputs(example_inputs)
    patterns = check_patterns(patterns)
    t0 = time.perf_counter()
    # The model itself runs (a deep copy of BERT-base costs more than its forward); every mode flag, every
    # buffer (BatchNorm running stats) and the global RNG are restored afterwards.
    flags = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            trace = trace_runtime(model, args, kwargs)
            regions = find_regions(model, trace.calls)
            analysis = Analysis(model, trace, regions, type(model).__name__)
    finally:
        for m, flag in flags.items():
            m.training = flag
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    plan = analysis.plan(patterns)
    plan.analysis_seconds = time.perf_counter() - t0
    return plan



