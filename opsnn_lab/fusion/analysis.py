"""``analyze``: trace at run time, find candidates, check where fx can rewrite them, cost them."""

from __future__ import annotations

import collections
import dataclasses
import re
import time

import torch
from torch import nn

from opsnn_lab._checks import check_type
from opsnn_lab.fusion import checkpointing
from opsnn_lab.fusion.cost import CostModel
from opsnn_lab.fusion.distributed import check_not_distributed
from opsnn_lab.fusion.instance import dropout_streams, host_rngs, instance_state, restore_instance_state
from opsnn_lab.fusion.match import NORM_ACTS
from opsnn_lab.fusion.patterns import (
    FAMILIES,
    LINEAR_ACTS,
    Match,
    act_kind,
    find_all,
    op_name,
    pattern_of,
)
from opsnn_lab.fusion.plan import Decision, FusionPlan
from opsnn_lab.fusion.regions import Region, error_line, find_regions, library_hooks
from opsnn_lab.fusion.routes import Route, RoutePlanner, inline_view
from opsnn_lab.fusion.runtime import RuntimeTrace, buffers_kept, own_dtypes, trace_runtime

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


_VARIANT = re.compile(rf"conv_bn_({'|'.join(sorted(NORM_ACTS))})(_maxpool)?|"
                      rf"linear_({'|'.join(sorted(LINEAR_ACTS))})(_dropout)?(_linear)?|"
                      rf"gated_(mlp|product)_({'|'.join(sorted(LINEAR_ACTS))})|"
                      rf"conv_({'|'.join(sorted(LINEAR_ACTS))})(_dropout)?_conv|"
                      rf"(group|instance)_norm_({'|'.join(sorted(NORM_ACTS))})")


def check_patterns(patterns) -> list[str] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"patterns must be a list of pattern names, got {patterns!r}")
    known = {*FAMILIES, "conv_bn_relu_maxpool", "linear_gelu_dropout_linear"}
    bad = [p for p in patterns if p not in known and not _VARIANT.fullmatch(p)]
    if bad:
        raise ValueError(f"patterns has unknown names {bad}; choose from {sorted(known)}")
    return list(patterns)


def _plain(value) -> bool:
    """A parameter a plan keeps (JSON): a number, string or flag, or a shape (a weightless norm's size)."""
    if isinstance(value, tuple):
        return all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, (int, float, str, bool))


class Analysis:
    """Everything one trace found; ``plan(patterns)`` turns it into decisions without tracing again.

    Each viable chain is rewritten at module boundaries when the run-time record shows some (patch.py);
    torch.fx is asked only for the chains no module call carries (functional code inside one forward).
    """

    def __init__(self, model: nn.Module, trace: RuntimeTrace, name: str, forwards: int = 1,
                 checkpointed: tuple[str, ...] = ()):
        self.model, self.trace, self.name = model, trace, name
        # node name -> what checkpoints it (a layer with gradient checkpointing on, ``checkpointed``, or a
        # torch.utils.checkpoint call), for the nodes that run checkpointed (checkpointing.py)
        self.units = checkpointing.inside(trace.graph, checkpointed, trace.checkpointed)
        # what a step keeps nothing of, fused or not: the nodes inside a checkpoint, those run without gradients, and
        # those of a computation the forward dropped (``runtime.dropped_by_forward``)
        self.dropped = frozenset(self.units) | trace.without_grad | trace.dropped
        where = "the analysis forward" if forwards == 1 else f"any of the {forwards} analysis forwards"
        # modules holding parameters of which nothing ran: no candidate of theirs was seen; they run as they are
        self.not_analysed = {p or "<model>": f"not called in {where} (skipped by layerdrop or a branch): not analysed, "
                             "it runs unfused" for p in trace.not_called}
        self.cost = CostModel(trace, lambda m: pattern_of(m.pattern).build(m))
        self.step_total = self.cost.fused_total([], self.dropped)  # what a step of the model keeps, unfused
        viable = [m for m in find_all(trace.graph) if m.viable]
        planner = RoutePlanner(trace, viable)
        self.routes: dict[tuple, Route] = {}  # match key -> module-level route
        self.why_not: dict[tuple, str] = {}  # match key -> why no module call carries it
        self.matches: dict[tuple, Match] = {}
        for m in viable:
            self.matches[m.key] = m
            route = planner.route(m)
            if isinstance(route, Route):
                self.routes[m.key] = route
            else:
                self.why_not[m.key] = route
        # module routes patching a module called more than once: every call is this chain (routes.RoutePlanner)
        self.shared: dict[tuple, tuple[str, int]] = {k: v for k, v in planner.shared.items() if k in self.routes}
        verdicts = {k: v for k, v in trace.graph.memo.items()
                    if isinstance(k, tuple) and k[0] in ("norm", "norm_shape", "norm_cast", "norm_dim")}

        def wanted(graph) -> list:  # the chains a region's graph holds that only fx can rewrite (found once)
            if "wanted" not in graph.memo:
                graph.memo.update(verdicts)  # Python norms fx inlined: what the run-time record found them to be
                graph.memo["wanted"] = [m for m in find_all(graph)
                                        if m.viable and (m.key in self.why_not or m.key in self.shared)]
            return graph.memo["wanted"]

        self.regions: list[Region] = find_regions(model, trace.calls, lambda g: bool(wanted(g))) \
            if self.why_not or self.shared else []
        self.rewritable: dict[tuple, str] = {k: r.label for k, r in self.routes.items()}  # match key -> route
        self.fx_routes: dict[tuple, str] = {}  # match key -> fx region, for keys a module patch does not carry
        self.fx_params: dict[tuple, dict] = {}  # match key -> what its op is built with in that region's code
        sites = collections.Counter(m.key for m in viable)
        for r in self.regions:
            if r.route == "fx":
                calls = sum(c.path == r.path for c in trace.module_calls) if r.path else 1
                here = collections.Counter(m.key for m in wanted(r.graph))
                for m in wanted(r.graph):
                    if here[m.key] * calls > sites[m.key]:  # the code would fuse a site the record turned down
                        self.why_not.setdefault(m.key, "")
                        self.why_not[m.key] += (f"{'; ' if self.why_not[m.key] else ''}the code of "
                                                f"`{r.path or '<model>'}` holds {here[m.key]} of its chains a call, "
                                                "and one of them is not viable in the run-time record (what it "
                                                "computes is read after the region): fx would fuse them all")
                        continue
                    self.fx_routes.setdefault(m.key, f"fx:{r.path or '<model>'}")
                    self.fx_params.setdefault(m.key, {k: v for k, v in m.params.items() if _plain(v)})
        for k, label in self.fx_routes.items():
            self.rewritable.setdefault(k, label)
        for k in self.why_not:  # an SDPA call inside a forward fx cannot trace: redirected at the call (patch.py)
            if k not in self.rewritable and (box := self._sdpa_host(self.matches[k])) is not None:
                self.routes[k] = Route("sdpa", (box.path,))
                self.rewritable[k] = self.routes[k].label
        for k, why in self.why_not.items():
            if k not in self.rewritable and (box := _container_across(self.regions, self.matches[k])):
                self.why_not[k] = (f"{why}; its steps run in different children of `{box.path or '<model>'}`, which "
                                   "runs its children in turn, so fx does not rewrite it (a fused op registered there "
                                   "would become one more step)")
        for k, why in self.why_not.items():
            if k not in self.rewritable and (box := _untraceable_around(self.regions, self.matches[k])):
                self.why_not[k] = f"{why}; nor can fx trace `{box.path or '<model>'}` ({box.reason})"
        self.costs: dict[tuple, tuple[int, int, int]] = {}  # match site -> saved, traffic, eager bytes
        for m in viable:
            if m.key in self.rewritable:
                try:
                    self.costs[_site(m)] = self.cost.site(self._as_rewritten(m),
                                                          own_code=self.rewritable[m.key].startswith("module:"))
                except Exception as exc:  # noqa: BLE001 - the op cannot take this chain: decline it, not the model
                    del self.rewritable[m.key]
                    self.why_not[m.key] = (f"the fused op failed on the chain's recorded inputs ({type(exc).__name__}: "
                                           f"{error_line(exc)[:200]}); it runs unfused")
        self.trace.tensors.clear()  # activations (and the autograd graph holding them) are no longer needed
        self.trace.output = None

    def _as_rewritten(self, m: Match) -> Match:
        """``m`` with what its op is built with where it will run: a region's code may need a variant the run-time
        record does not show (eager attention code returns its probabilities beside the output: the op returns
        them too, and saves neither its output nor the row statistics then), so the cost is that variant's."""
        if not self.rewritable[m.key].startswith("fx:"):
            return m
        extra = {k: v for k, v in self.fx_params.get(m.key, {}).items() if k not in m.params}
        return dataclasses.replace(m, params={**m.params, **extra}) if extra else m

    def _sdpa_host(self, m: Match) -> Region | None:
        """The region of the module whose forward, which fx cannot trace, makes ``m``'s one
        ``scaled_dot_product_attention`` call, when each of its calls makes exactly one; else None."""
        n = m.nodes[0]
        if m.pattern != "attention" or len(m.nodes) != 1 or n.op != "scaled_dot_product_attention" \
                or n.kind != "function" or not n.scope:
            return None
        box = _untraceable_around(self.regions, m)
        if box is None or box.path != n.scope:
            return None
        calls = sum(c.path == n.scope for c in self.trace.module_calls)
        made = sum(x.op == n.op and x.scope == n.scope for x in self.trace.graph.nodes)
        return box if calls and made == calls else None

    def _without_grad(self, m: Match) -> bool:
        return all(n.name in self.trace.without_grad for n in m.nodes)

    def _dropped_by_forward(self, m: Match) -> bool:
        """The chain's result is part of a computation the forward drops: nothing it saves outlives the forward."""
        return any(n.name in self.trace.dropped for n in m.nodes)

    def _not_rewritable(self, m: Match, why_not: dict) -> str:
        why = why_not.get(m.key, "")
        return f"cannot be rewritten: {why}" if why else "cannot be rewritten here"

    def not_worth(self, m: Match, worse: dict | None = None) -> str:
        """Why a rewritable match is not worth fusing where it is ('' when it is): a pattern whose gain is
        memory must save its share of the chain's activation bytes (``Pattern.min_share``), or at least not keep
        more than eager (``Pattern.never_worse``); and not keep more beside the plan's other fused chains than
        unfused there (``worse``: site -> why, from ``_worse_together``)."""
        if worse and _site(m) in worse:
            return worse[_site(m)]
        if why := checkpointing.crossing(m, self.units):
            return why
        if self._without_grad(m) or self._dropped_by_forward(m):  # nothing kept, fused or not: the other sites
            return ""  # of its key decide
        if not _memory_pattern(m.pattern) or _site(m) not in self.costs:
            return ""
        pat = pattern_of(m.pattern)
        saved, _, eager = self.costs[_site(m)]
        if saved >= 0 and (not pat.min_share or (saved > 0 and saved >= pat.min_share * eager)):
            return ""
        if saved < 0:
            return (f"not fused: would keep {-saved:,} activation bytes more than eager's {eager:,} here; "
                    f"{pat.needs}")
        return (f"not fused: saves {saved:,} of its {eager:,} activation bytes here (under {pat.min_share:.0%}); "
                f"{pat.needs}")

    def decision(self, m: Match, rewritable: dict | None = None, why_not: dict | None = None,
                 worse: dict | None = None) -> Decision:
        """``m``'s decision under a plan's routes (default: the analysis's own)."""
        rewritable = self.rewritable if rewritable is None else rewritable
        d = Decision(m.pattern, m.modules, m.ok, m.reason, chain=[n.label for n in m.nodes],
                     nodes=[n.name for n in m.nodes],
                     shapes=[n.shape for n in m.nodes],
                     params={k: v for k, v in m.params.items() if _plain(v)})
        if m.ok and m.key not in rewritable:
            d.fused, d.reason = False, self._not_rewritable(m, self.why_not if why_not is None else why_not)
        elif m.ok:
            d.saved_bytes, d.traffic_bytes = self.costs[_site(m)][:2]  # a declined match shows what it would save
            if self._without_grad(m):
                d.saved_bytes = 0
                d.reason += ("; runs with gradients off here (torch.no_grad in the forward): nothing is saved for "
                             "backward, fused or not")
            elif self._dropped_by_forward(m):
                d.saved_bytes = 0
                d.reason += ("; the forward drops its result here (nothing holds it, or what it feeds, once the "
                             "forward returns): what it saves is freed before backward, fused or not")
            why = self.not_worth(m, worse)
            if why:
                d.fused, d.reason = False, why
                return d
            d.route = rewritable[m.key]
            if d.saved_bytes < 0:  # a pattern fused for time (qkv: one GEMM) may keep more than eager does
                d.reason += (f"; keeps {-d.saved_bytes:,} activation bytes more than eager here: what reads its "
                             "outputs saves views of them, which keep the op's whole output buffer alive")
            route = self.routes.get(m.key) if d.route.startswith("module:") else None
            if route is not None:
                d.carriers, d.first, d.ops = list(route.carriers), route.first, [act_kind(n) for n in m.nodes]
                for label, path in zip(route.after, route.carriers):
                    if label and inline_view(label):
                        views = [f"`{n.op}`" for n in m.nodes if n.name in m.views]
                        d.reason += (f"; {', '.join(views)} run{'s' if len(views) == 1 else ''} inline in "
                                     f"`{label.rpartition('.')[0] or '<model>'}`.forward before `{path}`: they view "
                                     "the fused output (the activation ran before them, where it gives the same "
                                     f"elements), and `{path}` checks at each call that it receives such a view")
                    elif label:
                        host = label.rpartition('.')[0] or '<model>'
                        d.reason += (f"; the `{label.rpartition('.')[2]}` run inline in `{host}`.forward before "
                                     f"`{path}` has p=0 here and runs as it is on the fused output: a setting of "
                                     f"`{host}` changed later (that p) runs the chain unfused, and `{path}` checks at "
                                     "each call that it receives the fused op's output")
            if route is not None and route.kind == "sdpa":
                d.reason += (f"; `{route.carriers[0]}` runs its own forward (fx cannot trace it: see the plan's "
                             "routes), its scaled_dot_product_attention call redirected to the fused core")
            if route is not None and m.key in self.shared:
                path, n = self.shared[m.key]
                d.reason += f"; `{path}` runs {n} times per forward, each call this chain: its one rewrite serves all"
        return d

    def _decide(self, patterns, rewritable: dict, why_not: dict, worse: dict) -> list[Decision]:
        with torch.random.fork_rng(devices=[]):  # ops may draw a dropout seed when built to validate a chain
            return [self.decision(m, rewritable, why_not, worse)
                    for m in find_all(self.trace.graph, patterns,
                                      claims=lambda m: m.key in rewritable and not self.not_worth(m, worse))]

    def plan(self, patterns=None) -> FusionPlan:
        patterns = check_patterns(patterns)
        rewritable, why_not, worse = dict(self.rewritable), dict(self.why_not), {}
        decisions = self._settle(patterns, rewritable, why_not, worse)
        for _ in range(len(decisions)):  # one chain declined a round, the worst first: the others' costs change
            declined = self._worse_together(decisions)
            if not declined:
                break
            worse.update(declined)
            decisions = self._settle(patterns, rewritable, why_not, worse)
        together = self.saved_together(decisions)
        checkpointing.settle(decisions, self.units)
        return FusionPlan(decisions, [r.to_dict() for r in self.regions], self.step_total, patterns, self.name,
                          graph=graph_data(self.trace), saved_together=together,
                          not_analysed=dict(self.not_analysed), _analysis=self)

    def saved_together(self, decisions: list[Decision]) -> int:
        """Activation bytes the fused ``decisions`` save together across a step (``plan.saved_bytes``): a chain inside
        a checkpoint, run with gradients off, or in a computation the forward drops saves nothing there, fused or
        not."""
        return self.step_total - self.cost.fused_total(self._kept_sites(decisions), self.dropped)

    def _kept_sites(self, decisions: list[Decision]) -> list[tuple]:
        """The fused decisions' sites whose op keeps what it saves across the step (``dropped``: none of theirs)."""
        return [(d.key, tuple(d.nodes)) for d in decisions if d.fused and not self.dropped & set(d.nodes)]

    def _worse_together(self, decisions: list[Decision]) -> dict:
        """The fused chain of a memory pattern (``min_share`` / ``never_worse``) that keeps the most activation
        bytes beside the other fused chains, more than the plan keeps with it unfused, as {site: why} (every call
        site of its key: one rewrite serves them all, so they are weighed together); {} if none. Alone it saved
        enough, but what it shares with another op changes: an attention core reading views of a packed QKV
        output keeps that whole buffer alive where eager's projections keep three tensors."""
        fused = [d for d in decisions if d.fused]
        sites = self._kept_sites(decisions)
        held = self.cost.fused_total(sites, self.dropped)
        worst = None
        for key in dict.fromkeys(d.key for d in fused if _memory_pattern(d.pattern)):
            others = [s for s in sites if s[0] != key]
            extra = held - self.cost.fused_total(others, self.dropped)
            if extra > 0 and (worst is None or extra > worst[0]):
                worst = (extra, key, others)
        if worst is None:
            return {}
        extra, key, others = worst
        mine = [s for s in sites if s[0] == key]
        alone = [s for s in others if self.cost.fused_total([*mine, s]) > self.cost.fused_total([s])]
        beside = "the fused " + ", ".join(dict.fromkeys(f"{p} ({', '.join(mods)})" for (p, mods), _ in alone)) \
            if alone else "the other fused chains"
        saves = sum(d.saved_bytes for d in fused if d.key == key)
        why = (f"not fused: beside {beside} it would keep {extra:,} activation bytes more than unfused "
               f"there (alone it saves {saves:,}): what one op keeps holds a storage the other would let go (a saved "
               "view keeps its whole buffer alive)")
        return dict.fromkeys(mine, why)

    def _settle(self, patterns, rewritable: dict, why_not: dict, worse: dict) -> list[Decision]:
        """The decisions once every rewritten key's call sites agree (see below)."""
        decisions = self._decide(patterns, rewritable, why_not, worse)
        # A rewrite serves every call site of its key: a patch of a shared module runs at each call; the fx rewrite
        # takes each site that matches there and that no other planned chain holds, so a site declined for its
        # bytes would be fused too. Where one site is fused and another is not, the key goes to its fx route when
        # only overlaps keep the others, or is fused nowhere; then the plan is made again.
        for _ in range(len(decisions)):
            split = {}
            for key, sites in _sites_by_key(decisions).items():
                others = [d for d in sites if not d.fused]
                if not others or len(others) == len(sites):
                    continue
                overlaps = all(d.reason.startswith("overlaps the fused ") for d in others)
                declined = next((d.reason for d in others if d.reason.startswith(_FOR_BYTES)), "")
                if rewritable[key].startswith("module:") or declined:
                    split[key] = (overlaps, declined or others[0].reason)
            if not split:
                break
            for key, (overlaps, why) in split.items():
                if overlaps and key in self.fx_routes:
                    rewritable[key] = self.fx_routes[key]
                    continue
                m, route = self.matches[key], rewritable.pop(key)
                path, n = self.shared.get(key, (None, 0)) if route.startswith("module:") else (None, 0)
                where = f"`{path}` runs {n} times per forward and" if path else \
                    f"{', '.join(f'`{p}`' for p in m.modules)} run at several call sites and"
                why_not[key] = (f"{where} its rewrite ({route}) changes every call, but one is not fused ({why}); to "
                                f"fuse the others alone, call opsnn_lab.ops.{op_name(m)} there")
            decisions = self._decide(patterns, rewritable, why_not, worse)
        return decisions


_FOR_BYTES = ("not fused: saves", "not fused: beside")  # a site declined for its bytes (not_worth, _worse_together)


def _memory_pattern(name: str) -> bool:
    pat = pattern_of(name)
    return bool(pat.min_share or pat.never_worse)


def _innermost(regions: list[Region], route: str, m: Match, holds) -> Region | None:
    """The innermost region routed ``route`` for which ``holds(prefix, places)`` is true of ``m``'s steps (their
    module paths, ``prefix`` the region's path and a dot); None if there is none."""
    places = [n.module or n.scope for n in m.nodes if n.kind in ("module", "function")]
    for r in sorted((r for r in regions if r.route == route), key=lambda r: -len(r.path)):
        if holds(f"{r.path}." if r.path else "", places):
            return r
    return None


def _container_across(regions: list[Region], m: Match) -> Region | None:
    """The innermost region routed "container" (regions.py: an nn.Sequential) whose children hold ``m``'s steps
    between them, more than one; None if the chain sits inside one of its children or in no container."""
    return _innermost(regions, "container", m, lambda pre, places: all(p.startswith(pre) for p in places)
                      and len({p[len(pre):].split(".")[0] for p in places}) > 1)


def _untraceable_around(regions: list[Region], m: Match) -> Region | None:
    """The innermost module fx failed to trace whose forward holds all of ``m``'s steps (its reason says why the
    fx route, which rewrites inside one forward, is closed too); None if there is none."""
    return _innermost(regions, "untraceable", m,
                      lambda pre, places: all(p == pre[:-1] or p.startswith(pre) for p in places))


def _sites_by_key(decisions: list[Decision]) -> dict[tuple, list[Decision]]:
    """Decisions of keys with more than one call site (a module called twice gives one key two)."""
    by: dict[tuple, list[Decision]] = {}
    for d in decisions:
        by.setdefault(d.key, []).append(d)
    return {k: v for k, v in by.items() if len(v) > 1}


def _site(m: Match) -> tuple:
    """One call site of a match (a module called twice gives one key two sites, whose costs may differ)."""
    return m.key, tuple(n.name for n in m.nodes)


def graph_data(trace: RuntimeTrace) -> dict:
    """Nodes (module name or op, type, scope, shape) and edges of the trace, for views."""
    nodes = [{"name": n.name, "label": n.label, "op": n.op, "kind": n.kind, "scope": n.scope,
              "type": type(n.obj).__name__ if n.obj is not None else n.op, "shape": n.shape}
             for n in trace.graph.nodes]
    edges = [[i, n.name] for n in trace.graph.nodes for i in dict.fromkeys(n.inputs)]
    return {"nodes": nodes, "edges": edges}


def _stream_steps(model: nn.Module) -> list[int]:
    """Where the model's own random streams are (counter-RNG modules, ``make_reproducible``'s step)."""
    from opsnn_lab.consistency.seed_pool import get_step
    from opsnn_lab.consistency.streams import counter_streams

    steps = [m.rng_step for _, m in counter_streams(model)]
    return steps + ([get_step(model)] if getattr(model, "_opsnn_reproducible", None) is not None else [])


FORWARDS = 8  # recorded forwards at most, while a module holding parameters did not run and the RNG moved


def _record(model: nn.Module, args, kwargs, devices, restore, checkpointed=()) -> tuple[RuntimeTrace, int]:
    """The recorded forward in which the fewest parameters sat in modules that did not run, and how many forwards
    were recorded: another one (buffers restored first; the random streams go on) while some module holding
    parameters did not run and the forward drew random numbers (a layerdrop's draw; a data-dependent branch on
    the same inputs and weights would take the same way again), ``FORWARDS`` in all."""
    best, left = None, 0
    for n in range(1, FORWARDS + 1):
        before = _rng_states(devices), _stream_steps(model)
        trace = trace_runtime(model, args, kwargs, checkpointed)
        missing = sum(p.numel() for path in trace.not_called for p in model.get_submodule(path).parameters())
        if best is None or missing < left:
            best, left = trace, missing
        drew = before[1] != _stream_steps(model) or _drew(before[0], _rng_states(devices))
        if not missing or not drew:
            return best, n
        restore()
    return best, FORWARDS


def _rng_states(devices) -> tuple[list[torch.Tensor], dict]:
    """The torch RNG states a forward may draw from (CPU, the model's CUDA devices), and Python's and numpy's."""
    from opsnn_lab.consistency.functional import foreign_states

    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)], foreign_states()


def _drew(before, after) -> bool:
    from opsnn_lab.consistency.functional import moved_foreign

    return not all(torch.equal(a, b) for a, b in zip(before[0], after[0])) or bool(moved_foreign(before[1], after[1]))


def analyze(model: nn.Module, example_inputs, patterns=None) -> FusionPlan:
    """Trace ``model`` on ``example_inputs`` (a forward in train mode) and decide every candidate.

    Candidates are found in what the recorded forward ran. Where a module holding parameters did not run and the
    forward drew random numbers (a layerdrop), another forward is recorded, ``FORWARDS`` at most, and the one
    leaving the fewest parameters out is analysed; the modules it leaves out are listed in
    ``FusionPlan.not_analysed`` with why (they run unfused).

    The model's mode flags, its buffers, its dropout streams (counter-RNG steps, the ``make_reproducible``
    step), what its forward writes in its modules' attributes and in the plain objects they hold (a cache), and the
    global RNGs (torch's, Python's, numpy's) are left as they were. Called inside
    ``torch.autocast``, the forward is recorded with autocast off (``runtime.own_dtypes``): the plan is about the
    model's own dtypes, the one made outside autocast, and the fused ops it picks apply autocast's casts
    themselves when they run under it.
    """
    check_type("model", model, nn.Module)
    check_not_distributed(model)
    args, kwargs = split_inputs(example_inputs)
    patterns = check_patterns(patterns)
    t0 = time.perf_counter()
    # The model itself runs (a deep copy of BERT-base costs more than its forward); every mode flag, every
    # buffer (BatchNorm running stats) and the global RNG are restored afterwards.
    flags = {m: m.training for m in model.modules()}
    restore = buffers_kept(model)
    streams = dropout_streams(model)
    # what the forwards write in the modules and the plain objects they hold (a cache of text embeddings filled
    # with tensors holding the recorded graph) is put back too
    state = instance_state(model)

    def put_back() -> None:
        restore()
        streams()
        restore_instance_state(state)

    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})

    try:
        with torch.random.fork_rng(devices=devices), host_rngs(), own_dtypes(model, args, kwargs), \
                library_hooks(model), checkpointing.transparent():  # a model's own checkpoint calls run plain
            model.train()
            # with gradient checkpointing on, the layers' activations as their forward (and recompute) computes
            # them; their flags are back on for the regions' traces, which then meet the layers' checkpoints as
            # the rewrite will (a region holding a checkpointed layer is not traced whole: its code would run the
            # layer's ops without the checkpoint)
            with checkpointing.suspended(model) as checkpointed:
                trace, forwards = _record(model, args, kwargs, devices, restore, checkpointed)
            analysis = Analysis(model, trace, type(model).__name__, forwards, checkpointed)
    finally:
        for m, flag in flags.items():
            m.training = flag
        put_back()
    # ops are built (and some validated) as the chains' own dtypes run them; a region's size questions run its
    # code on the example, which moves buffers too (a spectral norm's power iteration): restored again
    try:
        with torch.random.fork_rng(devices=devices), host_rngs(), own_dtypes(model, args, kwargs):
            plan = analysis.plan(patterns)
    finally:
        put_back()
    plan.analysis_seconds = time.perf_counter() - t0
    return plan



