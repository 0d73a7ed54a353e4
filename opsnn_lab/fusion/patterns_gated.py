"""Pattern rows for gated MLPs: ``down(act(gate(x)) * up(x))`` whole (SwiGLU, GeGLU, Phi-3's packed
``gate_up``) and, where the projections are not plain Linears, the product ``act(gate) * up`` alone.

Like ``patterns.py``, one pure finder per row over the dataflow graph, each returning every candidate with a
reason; ``gated_mlp`` runs first and takes the products of the MLPs it fuses whole.
"""

from __future__ import annotations

import torch
from torch import nn

from opsnn_lab.fusion.graph import ACTIVATIONS, Graph, Node, arg
from opsnn_lab.fusion.match import (
    LINEAR_ACTS,
    Match,
    _common_checks,
    _consumer_reason,
    _dropout_module,
    _is_module,
    _op_support,
    act_kind,
    act_module,
    inplace_reason,
    op_class,
    past_identities,
)

__all__ = ["find_gated_mlp", "find_gated_products", "build_gated_mlp", "build_gated_product", "GatedProduct"]


def _positions(g: Graph) -> dict[str, int]:
    pos = g.memo.get("positions")
    if pos is None or len(pos) != len(g.nodes):
        pos = g.memo["positions"] = {n.name: i for i, n in enumerate(g.nodes)}
    return pos


# --------------------------------------------------------------------------- down(act(gate(x)) * up(x))
def find_gated_mlp(g: Graph) -> list[Match]:
    out, pos = [], _positions(g)
    for mul in g.nodes:
        if mul.op != "mul" or len(mul.inputs) != 2 or mul.inputs[0] == mul.inputs[1]:
            continue
        a, b = (g[i] for i in mul.inputs)
        act, up = (a, b) if act_kind(a) in ACTIVATIONS else (b, a)
        gate = g.producer(act) if act_kind(act) in ACTIVATIONS else None
        if gate is not None and gate is up and gate.op == "chunk":  # one Linear computes [gate | up]
            m = _packed_match(g, gate, act, mul)
            if m is not None:
                out.append(_with_down(g, m, mul, pos))
            continue
        if gate is not None and gate.op == up.op == "getitem" and g.producer(gate) is g.producer(up) is not None \
                and g.producer(gate).op == "chunk":  # the same in a traced graph: one getitem per half
            m = _packed_match(g, g.producer(gate), act, mul, (gate, up))
            if m is not None:
                out.append(_with_down(g, m, mul, pos))
            continue
        if not (_is_module(gate, "linear") and _is_module(up, "linear")) or gate.inputs[:1] != up.inputs[:1]:
            continue  # not two projections of one tensor, one of them activated
        m = Match(f"gated_mlp_{act_kind(act)}", [gate, act, up, mul], False, "", inputs=gate.inputs[:1])
        m.params = {"gate": gate.obj, "up": up.obj}
        m.reason = _consumer_reason(g, gate, act) or _consumer_reason(g, act, mul) or _consumer_reason(g, up, mul)
        out.append(_with_down(g, m, mul, pos))
    return out


def _packed_match(g: Graph, chunk: Node, act: Node, mul: Node, items: tuple[Node, Node] | None = None) -> Match | None:
    """``gate, up = gate_up(x).chunk(2, -1); down(up * act(gate))`` (Phi-3; diffusers' GEGLU activates the
    second half): None when ``chunk`` is not two halves of a Linear's output; else a match, rejected where the
    recorded tensors cannot tell which half is activated. ``items``:
    the (gate, up) getitem nodes of a traced graph; a run-time record has none (the halves are read directly)."""
    gate_up = g.producer(chunk)
    dim = arg(chunk, 2, "dim", 0)
    last = -1 if chunk.shape is None else len(chunk.shape) - 1  # a traced graph records no shapes
    if not _is_module(gate_up, "linear") or arg(chunk, 1, "chunks", None) != 2 or dim not in (-1, last):
        return None
    steps = [gate_up, chunk, *(items or ()), act, mul]
    m = Match(f"gated_mlp_{act_kind(act)}", sorted(steps, key=lambda n: _positions(g)[n.name]), False, "",
              inputs=gate_up.inputs[:1])
    m.params = {"gate_up": gate_up.obj}
    halves = {act.name, mul.name} if items is None else {i.name for i in items}
    readers = {u.name for u in g.users.get(chunk.name, [])}
    m.reason = (_consumer_reason(g, gate_up, chunk) or _consumer_reason(g, act, mul)
                or ("" if readers == halves else f"the halves of `{chunk.label}` are read elsewhere too")
                or (items and (_consumer_reason(g, items[0], act) or _consumer_reason(g, items[1], mul))) or "")
    key = ("packed_gate_first", chunk.name)
    if key not in g.memo:  # which half is activated: the getitem's index, else the recorded tensors
        g.memo[key] = arg(items[0], 1, "index", None) == 0 if items else _gate_half(g, gate_up, act)
    first = m.params["gate_first"] = g.memo[key]
    if not m.reason and first is None:
        m.reason = f"cannot tell which half of `{gate_up.label}`'s output is activated"
    return m


def _gate_half(g: Graph, gate_up: Node, act: Node) -> bool | None:
    """True / False when the recorded activation output is the activation of the first / second half."""
    gu, seen, fn = g.tensors.get(gate_up.name), g.tensors.get(act.name), act_module(act)
    if gu is None or seen is None or fn is None:
        return None
    with torch.no_grad():
        for first, half in ((True, gu.chunk(2, -1)[0]), (False, gu.chunk(2, -1)[1])):
            if half.shape == seen.shape and torch.equal(fn(half), seen):
                return first
    return None


def _with_down(g: Graph, m: Match, mul: Node, pos: dict) -> Match:
    """The gated product's dropout and the ``down`` Linear reading it; the op's own verdict."""
    tail, drop = mul, None
    passed, nxt = past_identities(g, mul)
    if nxt is not None and nxt.op == "dropout":
        drop, tail = nxt, nxt
        m.nodes += [*passed, drop]
        passed, nxt = past_identities(g, drop)
    down = nxt
    act = next(n for n in m.nodes if act_kind(n) in ACTIVATIONS)
    m.reason = m.reason or _consumer_reason(g, mul, g.only_user(mul))
    if not m.reason and not _is_module(down, "linear"):
        users = ", ".join(f"`{u.label}`" for u in g.users.get(tail.name, []))
        m.reason = f"the gated product `{tail.label}` goes to {users or 'nothing'}, not straight into a Linear"
    if m.reason:
        return m
    m.nodes = sorted([*m.nodes, *passed, down], key=lambda n: pos[n.name])
    m.outputs = [down]
    p = m.params
    p.update(down=down.obj, act=act_module(act), dropout=_dropout_module(drop))
    if "gate_up" in p:
        ok, why = op_class("FusedGatedMLP").supports_packed(p["gate_up"], p["down"], p["act"], p["dropout"])
        m.reason = "" if ok else f"FusedGatedMLP: {why}"
    else:
        m.reason = _op_support("FusedGatedMLP", p["gate"], p["up"], p["down"], p["act"], p["dropout"])
    m.reason = m.reason or _common_checks(g, m.nodes)
    m.ok = not m.reason
    return m


def build_gated_mlp(m: Match) -> nn.Module:
    p = m.params
    if "gate_up" in p:
        return op_class("FusedGatedMLP").from_packed(p["gate_up"], p["down"], p["act"], p["dropout"], register=False,
                                                     gate_first=p["gate_first"])
    return op_class("FusedGatedMLP").from_modules(p["gate"], p["up"], p["down"], p["act"], p["dropout"],
                                                  register=False)


# --------------------------------------------------------------------------- act(gate) * up alone
def find_gated_products(g: Graph) -> list[Match]:
    """``act(gate) * up`` where only the product reads the activation: what stays fusable of a gated MLP whose
    projections are not plain Linears (low-rank adapters around them, quantised layers, hand-written experts).
    Runs after ``find_gated_mlp``, which takes the products of the MLPs it fuses whole."""
    out = []
    for mul in g.nodes:
        if mul.op != "mul" or mul.kind != "function" or len(mul.inputs) != 2 or len(mul.args) != 2:
            continue
        a, b = (g[i] for i in mul.inputs)
        act, up = (a, b) if act_kind(a) in LINEAR_ACTS else (b, a)
        if act_kind(act) not in LINEAR_ACTS or act.inplace or not act.inputs or _consumer_reason(g, act, mul):
            continue  # an activation read elsewhere too (a squeeze-excitation's pooling) is no gate of a product
        gate = g[act.inputs[0]]
        m = Match(f"gated_product_{act_kind(act)}", [act, mul], False, "", inputs=[gate.name, up.name], outputs=[mul],
                  params={"act": act_module(act)})
        if gate.name == up.name:
            m.reason = f"`{mul.label}` multiplies the activation by its own input (a pointwise activation, not a gate)"
        elif not (gate.shape == up.shape == mul.shape and gate.dtype == up.dtype == mul.dtype):
            m.reason = (f"`{mul.label}` broadcasts or mixes dtypes ({gate.shape} {gate.dtype} gate, "
                        f"{up.shape} {up.dtype} up)")
        m.reason = (m.reason or _op_support("FusedGatedProduct", m.params["act"])
                    or inplace_reason(g, mul) or _common_checks(g, m.nodes))
        m.ok = not m.reason
        out.append(m)
    return out


class GatedProduct(nn.Module):
    """``forward(gate, up) -> act(gate) * up`` by the fused op; a call it does not take (other shapes or dtypes
    than the traced ones: broadcasting, mixed precision) runs the model's activation and product as eager."""

    def __init__(self, op: nn.Module, act: nn.Module):
        super().__init__()
        self.op = op
        object.__setattr__(self, "act", act)  # the model's module (or a functional call's twin), not a child

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape == up.shape and gate.dtype == up.dtype and gate.is_floating_point() \
                and gate.device == up.device:
            return self.op(gate, up)
        return self.act(gate) * up


def build_gated_product(m: Match) -> nn.Module:
    return GatedProduct(op_class("FusedGatedProduct").from_modules(m.params["act"]), m.params["act"])
