"""Which module calls carry a fused chain (``Route``, ``RoutePlanner``): the module-level routes patch.py binds.

A route names the modules whose forwards are patched and how (``module:chain``, ``module:qkv``, ``module:whole``,
``module:sdpa``; patch.py's docstring describes each); the planner reads the run-time record to find them, or says
why a chain has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from opsnn_lab.fusion.graph import arg
from opsnn_lab.fusion.match import VIEW_OPS
from opsnn_lab.fusion.patterns import Match, op_name
from opsnn_lab.fusion.runtime import ModuleCall, RuntimeTrace

__all__ = ["Route", "RoutePlanner", "inline_identity", "inline_view", "inline_after"]


@dataclass(frozen=True)
class Route:
    kind: str  # "chain" | "qkv" | "whole" | "sdpa"
    carriers: tuple[str, ...]  # chain: the module of each step (first gets the op); qkv: q, k, v; whole, sdpa: one
    first: int = 0  # qkv: which sibling the model calls first (it runs the packed GEMM)
    after: tuple[str, ...] = ()  # chain: per carrier, the identity op or view run inline just before it ('' if none)

    @property
    def label(self) -> str:
        return f"module:{self.kind}"


class RoutePlanner:
    """Finds, for a candidate chain, the module calls that carry it (or says why none does).

    ``matches``: every viable candidate. A module called more than once per forward (ALBERT's shared layer)
    carries a chain only when each of its calls is a step of a candidate with the same key: the one patch then
    computes that chain at every call. ``shared`` names those keys with the module and its call count."""

    def __init__(self, trace: RuntimeTrace, matches=()):
        self.trace = trace
        self.index = {n.name: i for i, n in enumerate(trace.graph.nodes)}
        self.by_path: dict[str, list[ModuleCall]] = {}
        self.order = {id(c): k for k, c in enumerate(trace.module_calls)}
        for c in trace.module_calls:
            self.by_path.setdefault(c.path, []).append(c)
        self.sites: dict[tuple, list[Match]] = {}
        for m in matches:
            self.sites.setdefault(m.key, []).append(m)
        self.shared: dict[tuple, tuple[str, int]] = {}  # match key -> (a module it patches, its calls per forward)

    def _enclosing(self, i: int) -> list[ModuleCall]:
        """Calls running while node ``i`` was recorded, innermost first."""
        calls = (c for c in self.trace.module_calls if c.start <= i < c.end)
        return sorted(calls, key=lambda c: (-c.start, c.end, -self.order[id(c)]))

    def _once(self, path: str, m: Match, whole: bool = False) -> str:
        """'' when every call of ``path`` is this chain (one call, or one per candidate with ``m``'s key), else why
        a patch of ``path`` cannot carry it and what fuses this call site instead."""
        n = len(self.by_path.get(path, []))
        if n == 1:
            return ""
        same = self.sites.get(m.key, [m])
        k = len(same) if whole else sum(node.module == path for s in same for node in s.nodes)
        if k == n:
            self.shared.setdefault(m.key, (path, n))
            return ""
        scope = m.nodes[0].scope or "<model>"
        return (f"`{path}` runs {n} times per forward, {k} of them in this chain, and a module-level rewrite changes "
                f"every call; to fuse this call site alone, `{scope}`.forward must be traceable (the fx rewrite goes "
                f"call by call) or call opsnn_lab.ops.{op_name(m)} there")

    def _carrier(self, n, reads: list[str]) -> tuple[ModuleCall | None, str]:
        """The module call that computes exactly step ``n`` from ``reads``."""
        i = self.index[n.name]
        for c in self._enclosing(i):
            if c.end - c.start != 1:
                break  # the innermost call computing more than this step: no call isolates it
            if c.outputs == [n.name] and c.bare and c.inputs == reads and c.n_args == 1 and not c.kwargs:
                return c, ""
        where = n.scope or "the model"
        return None, f"`{n.op}` runs inline in `{where}`.forward, not in a module call of its own"

    def _chain(self, m: Match) -> Route | str:
        carriers, reads = [], list(m.inputs[:1])
        for i, n in enumerate(m.nodes):
            if carriers and i < len(m.nodes) - 1 and (inline_identity(n) or n.name in m.views) \
                    and n.inputs[:1] == reads:
                reads = [n.name]  # runs in the model's own code between two steps; the next one checks it was one
                continue
            c, why = self._carrier(n, reads)
            if c is None:
                return why
            if why := self._once(c.path, m):
                return why
            carriers.append(c.path)
            reads = [n.name]
        if len(set(carriers)) != len(carriers):
            return "one module computes two steps of the chain"
        return Route("chain", tuple(carriers), after=inline_after([n.label for n in m.nodes], carriers))

    def _whole(self, m: Match) -> Route | str:
        names = {n.name for n in m.nodes}
        idx = [self.index[n.name] for n in m.nodes]
        for c in self._enclosing(min(idx)):
            if c.end <= max(idx):
                continue
            inside = {self.trace.graph.nodes[j].name for j in range(c.start, c.end)}
            if inside != names:
                extra = [self.trace.graph.nodes[j].op for j in range(c.start, c.end)
                         if self.trace.graph.nodes[j].name not in names]
                ops = ", ".join(dict.fromkeys(extra[:4]))
                return (f"`{c.path or '<model>'}` also computes {ops} around the chain, and its steps are not "
                        "separate module calls")
            if c.inputs != list(m.inputs[:1]) or c.outputs != [m.outputs[-1].name] or not c.bare:
                return f"`{c.path or '<model>'}` reads or returns more than the chain's input and output"
            if c.n_args != 1 or c.kwargs:
                return f"`{c.path or '<model>'}` takes arguments besides the chain's input"
            return self._once(c.path, m, whole=True) or Route("whole", (c.path,))
        return "no module call contains the whole chain"

    def _qkv(self, m: Match) -> Route | str:
        paths, starts = [], []
        for n in m.nodes:
            c, _ = self._carrier(n, list(m.inputs[:1]))
            if c is None:
                return f"`{n.label}` is not called as `module(x)` on the shared input"
            if why := self._once(c.path, m):
                return why
            paths.append(c.path)
            starts.append(c.start)
        return Route("qkv", tuple(paths), starts.index(min(starts)))

    def route(self, m: Match) -> Route | str:
        """A Route, or the reason (about the computation) why no module boundary carries this chain."""
        if m.pattern == "qkv":
            return self._qkv(m)
        if m.pattern == "attention" or len(m.outputs) != 1 or len(m.inputs) != 1:
            first = m.nodes[0]
            where = f"`{first.label}` runs inline in `{first.scope or '<model>'}`.forward" if first.kind == "function" \
                else f"`{first.label}` is one step"
            return (f"{where} and the chain reads {len(m.inputs)} tensors and returns {len(m.outputs)}; a module-level "
                    "rewrite replaces a module call of one input and one output")
        if any(n.inputs[:1] != [prev.name] for prev, n in zip(m.nodes, m.nodes[1:])):
            return self._whole(m)  # not a straight chain (gated MLP, a norm's inner ops): one call must hold it all
        chain = self._chain(m)
        if isinstance(chain, Route):
            return chain
        whole = self._whole(m)
        return whole if isinstance(whole, Route) else f"{chain}; {whole}"


def inline_identity(n) -> bool:
    """A dropout called inline (not as a module) with p=0 in the recorded call: it returned its input."""
    return n.kind == "function" and n.op == "dropout" and arg(n, 1, "p", 0.5) == 0


def inline_view(label: str) -> bool:
    """Whether an inline step (a label of ``Route.after``) is a view step (``match.VIEW_OPS``) the model runs on the
    fused output, not an identity dropout: the next carrier receives a view of that output."""
    return label.rpartition(".")[2] in VIEW_OPS


def inline_after(labels: list[str], carriers) -> tuple[str, ...]:
    """Per carrier of a chain, the label of the inline step run just before it ('' when none): the chain's
    labels that are no carrier's (``Decision.chain`` and ``Decision.carriers`` give them back from a plan)."""
    after, pending, rest = [], "", list(carriers)
    for label in labels:
        if rest and label == rest[0]:
            after.append(pending)
            pending, rest = "", rest[1:]
        else:
            pending = label
    return tuple(after) if any(after) else ()


# --------------------------------------------------------------------------- the patches
