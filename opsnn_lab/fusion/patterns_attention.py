"""Attention's patterns over the dataflow graph of graph.py: the q/k/v projections (three sibling Linears
reading one tensor) and the core ``softmax(q @ k^T * scale + mask) -> dropout -> @ v``; the table is in
patterns.py."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from opsnn_lab.fusion.graph import Graph, Node, Ref, arg
from opsnn_lab.fusion.match import (
    Match,
    _common_checks,
    _consumer_reason,
    _dropout_module,
    _is_module,
    _op_support,
    op_class,
)
from opsnn_lab.ops.attention import SDPA_ARGS

__all__ = ["find_qkv", "find_attention", "build_qkv", "build_attention", "functional_stream", "name_functional"]


# --------------------------------------------------------------------------- sibling Linear layers (QKV)
_QKV_NAMES = (r"(q|query|q_proj|to_q|wq)", r"(k|key|k_proj|to_k|wk)", r"(v|value|v_proj|to_v|wv)")


def _named_triple(lins: list[Node]) -> list[Node] | None:
    """The Linears named as q, k and v (one each), in ``lins``' order; None when a role has no or two names."""
    roles = [[n for n in lins if re.fullmatch(p, n.module.rpartition(".")[2])] for p in _QKV_NAMES]
    if any(len(r) != 1 for r in roles):
        return None
    trio = {r[0].name for r in roles}
    return [n for n in lins if n.name in trio]


_ATTN_REACH = 64  # nodes looked at downstream of one projection (its reshapes, rotary, scaling) before giving up


def _attention_nodes(g: Graph) -> set[str]:
    """Where attention reads its operands: SDPA calls, softmax (q @ k^T feeds it) and the matmul reading the
    probabilities, past a dropout or a cast (@ v)."""
    key = "attention_nodes"
    if key not in g.memo:
        found = {n.name for n in g.nodes if n.op in ("scaled_dot_product_attention", "softmax")}
        for sm in [n for n in g.nodes if n.op == "softmax"]:
            frontier = [sm]
            for _ in range(3):
                frontier = [u for n in frontier for u in g.users.get(n.name, [])]
                found.update(u.name for u in frontier if u.op == "matmul")
        g.memo[key] = found
    return g.memo[key]


def _feeds_attention(g: Graph, lin: Node) -> bool:
    """Whether ``lin``'s output reaches an attention operand without passing through another layer."""
    targets, seen, todo = _attention_nodes(g), set(), [lin]
    while todo and len(seen) < _ATTN_REACH:
        n = todo.pop()
        for u in g.users.get(n.name, []):
            if u.name in targets:
                return True
            if u.name not in seen and u.kind != "output" and not _is_module(u, "linear") \
                    and not _is_module(u, "conv2d"):
                seen.add(u.name)
                todo.append(u)
    return False


def _qkv_triple(g: Graph, sibs: list[Node]) -> tuple[list[Node] | None, str]:
    """The q/k/v projections among the Linears reading one tensor, or None and why none three are.

    Three readers are the triple; with more (GPT-J's and Phi's parallel block: the MLP's ``fc_in`` reads the
    attention's input too), the three named q/k/v, else the only three feeding an attention."""
    if len(sibs) == 3:
        return sibs, ""
    named = _named_triple(sibs)
    if named is not None:
        return named, ""
    feeding = [s for s in sibs if _feeds_attention(g, s)]
    if len(feeding) == 3:
        return feeding, ""
    who = ", ".join(f"`{s.module}`" for s in sibs)
    return None, (f"{len(sibs)} Linear layers read `{g[sibs[0].inputs[0]].label}` ({who}); no three of them are "
                  f"named q/k/v, and {len(feeding)} (not 3) feed an attention")


def find_qkv(g: Graph) -> list[Match]:
    out, seen, unpicked = [], set(), []
    for x in g.nodes:
        sibs = [u for u in g.users.get(x.name, []) if _is_module(u, "linear") and u.inputs[:1] == [x.name]]
        if len(sibs) < 3:
            continue
        trio, why = _qkv_triple(g, sibs)
        if trio is None:
            if any(_feeds_attention(g, s) for s in sibs):  # an attention's projections among others
                unpicked.append(Match("qkv", sibs, False, why))
            continue
        sibs = trio
        seen.update(s.name for s in sibs)
        m = Match("qkv", sibs, False, "", inputs=[x.name], outputs=list(sibs),
                  params={"q": sibs[0].obj, "k": sibs[1].obj, "v": sibs[2].obj})
        biases = {s.obj.bias is not None for s in sibs}
        m.reason = _op_support("FusedQKV", build=lambda m=m: build_qkv(m, pack=False)) or _common_checks(g, sibs) or (
            "some siblings have a bias and some do not" if len(biases) > 1 else "")
        m.ok = not m.reason
        out.append(m)
    # Named q/k/v triples that do not share an input: say why they are not fused.
    by_scope: dict[str, list[Node]] = {}
    for n in g.nodes:
        if _is_module(n, "linear") and n.name not in seen:
            by_scope.setdefault(n.module.rpartition(".")[0], []).append(n)
    for lins in by_scope.values():
        trio = [next((n for n in lins if re.fullmatch(p, n.module.rpartition(".")[2])), None) for p in _QKV_NAMES]
        if all(trio) and len({tuple(n.inputs[:1]) for n in trio}) > 1:
            reads = ", ".join(f"`{n.module}` reads `{g[n.inputs[0]].label if n.inputs else '?'}`" for n in trio)
            out.append(Match("qkv", trio, False, f"the q/k/v projections read different tensors: {reads}"))
            seen.update(n.name for n in trio)
    # Readers of one tensor no triple was picked from, unless a named triple above already says why.
    return out + [m for m in unpicked if not seen & {n.name for n in m.nodes}]


# ------------------------------------------------------------- softmax(q @ k^T * scale + mask) -> dropout -> @ v
def find_attention(g: Graph) -> list[Match]:
    out = []
    for n in g.nodes:
        m = _attention_at(g, n) if n.op == "softmax" else _sdpa_at(g, n) if n.op == "scaled_dot_product_attention" \
            else _multihead_at(g, n) if n.kind == "module" and isinstance(n.obj, nn.MultiheadAttention) else None
        if m is not None:
            out.append(m)
    return out


def _multihead_at(g: Graph, n: Node) -> Match | None:
    """An ``nn.MultiheadAttention`` call that computes its attention weights (``need_weights=True``, the default)
    for a caller that never reads them (``mha(q, k, v)[0]``: RT-DETR's decoder, many models): the module keeps its
    (batch x heads, L, S) probabilities for backward, with their dropout mask and result. A built-in module opsnn_lab
    does not rewrite: declined, with what it keeps and the argument that keeps none of it."""
    if arg(n, 4, "need_weights", True) is not True:
        return None
    items = [u for u in g.users.get(n.name, []) if u.op == "getitem" and u.args[1:2] == (1,)]
    if len(items) != 1 or g.users.get(items[0].name) or items[0].shape is None:
        return None  # the weights are read (or were not returned): the caller wants them
    mha, shape = n.obj, items[0].shape
    elements = math.prod(shape) * (mha.num_heads if arg(n, 6, "average_attn_weights", True) is True else 1)
    kept = (3 if mha.dropout > 0 else 1) * elements * items[0].dtype.itemsize  # each (batch x heads, L, S)
    what = "probabilities, their dropout mask and the dropped probabilities" if mha.dropout > 0 else "probabilities"
    m = Match("attention", [n], False, "", outputs=[n], named=[n.module])
    then = ("it calls scaled_dot_product_attention, whose kernels keep no such tensor" if not mha.dropout else
            "it calls scaled_dot_product_attention, whose GPU kernels keep no such tensor (on CPU its dropout runs "
            "the math path, which keeps them as well)")
    m.reason = (f"nn.MultiheadAttention computes the attention weights it returns (need_weights=True, its default) "
                f"and nothing reads them here, yet it keeps its {mha.num_heads}-head {shape[-2]} x {shape[-1]} "
                f"{what} for backward ({kept:,} bytes); opsnn_lab does not rewrite this built-in module. With "
                f"need_weights=False {then}")
    return m


def _sdpa_arg(n: Node, name: str, default=None):
    return arg(n, SDPA_ARGS.index(name), name, default)


def _sdpa_at(g: Graph, n: Node) -> Match | None:
    """``F.scaled_dot_product_attention`` with dropout (Hugging Face's default attention in training): on CPU its
    dropout runs the math path, which saves the T x T probabilities and the mask; the fused op's counter-based
    dropout saves q, k, v and the mask only. Without dropout SDPA's own kernels save no T x T tensor: no match."""
    p = _sdpa_arg(n, "dropout_p", 0.0)
    if isinstance(p, Ref) or not p:
        return None
    mask = _sdpa_arg(n, "attn_mask")
    flags = {"is_causal": _sdpa_arg(n, "is_causal", False), "scale": _sdpa_arg(n, "scale"),
             "enable_gqa": _sdpa_arg(n, "enable_gqa", False)}
    q, k, v = (_sdpa_arg(n, name) for name in ("query", "key", "value"))
    m = Match("attention", [n], False, "", outputs=[n])
    if not all(isinstance(t, Ref) for t in (q, k, v)) or (mask is not None and not isinstance(mask, Ref)):
        m.reason = ("q, k, v or the mask is not a value the forward computed (a buffer or a constant); the fused op "
                    "takes computed values only")
        return m
    if any(isinstance(f, Ref) for f in flags.values()):
        m.reason = "is_causal, scale or enable_gqa is computed from a tensor"
        return m
    m.inputs = [q.name, k.name, v.name] + ([mask.name] if mask is not None else [])
    m.params = {"scale": None if flags["scale"] is None else float(flags["scale"]), "dropout_p": float(p),
                "is_causal": bool(flags["is_causal"]), "enable_gqa": bool(flags["enable_gqa"]),
                "rng_name": functional_stream(g, n)}
    t = g.tensors.get(q.name)
    if t is not None and t.device.type != "cpu":
        m.reason = (f"SDPA on {t.device.type}: its flash / memory-efficient kernels keep no T x T tensor for dropout "
                    "(only the CPU's math path does)")
        return m
    m.reason = _op_support("FusedAttention", build=lambda: build_attention(m)) or _common_checks(g, [n])
    m.ok = not m.reason
    return m


def _reaches_scores(g: Graph, n: Node, depth: int = 6) -> bool:
    """``n`` is ``q @ k^T``, or a scaling of it, a cap (``c * tanh(s / c)``) or an add onto it, within ``depth``
    steps."""
    if n.op == "matmul":
        return True
    if depth == 0 or len(n.inputs) not in (1, 2) or n.op not in ("mul", "div", "add", "tanh"):
        return False
    if n.op != "add" and len(n.inputs) != 1:  # a product of two tensors is no scaling
        return False
    return any(_reaches_scores(g, g[i], depth - 1) for i in n.inputs)


def _scores_side(g: Graph, a: Node, b: Node) -> tuple[Node, Node] | None:
    """``(scores, term)`` of an add of two computed tensors: the side that is (or adds onto) the scaled scores, the
    first where both could be (as before this looked past one add)."""
    return next(((s, t) for s, t in ((a, b), (b, a)) if _reaches_scores(g, s)), None)


def _constant(n: Node) -> float | None:
    """The number a one-tensor ``mul`` / ``div`` scales by (``s * c``, ``c * s``, ``s / c``: ``1 / c``); None
    where it is no plain number."""
    c = next((a for a in n.args[:2] if not isinstance(a, Ref)), None)
    if isinstance(c, bool) or not isinstance(c, (int, float)) or (n.op == "div" and not isinstance(n.args[0], Ref)):
        return None
    return float(c) if n.op == "mul" else 1.0 / float(c) if c else None


def _cap_at(g: Graph, x: Node | None) -> tuple[list[Node], float | str] | None:
    """``([div, tanh, mul], c)`` where ``x`` is ``c * tanh(s / c)`` (Gemma 2's soft cap of the scores; the
    division may be a product by ``1 / c``), ``(nodes, why)`` where it is a tanh between the scores and the
    softmax in another form, None where ``x`` is no ``tanh`` product."""
    if x is None or x.op != "mul" or len(x.inputs) != 1:
        return None
    t = g.producer(x)
    if t is None or t.op != "tanh" or len(t.inputs) != 1:
        return None
    d = g.producer(t)
    outer = _constant(x)
    inner = _constant(d) if d is not None and d.op in ("mul", "div") and len(d.inputs) == 1 else None
    nodes = [n for n in (d, t, x) if n is not None]
    if outer is None or inner is None or outer <= 0 or not math.isclose(outer * inner, 1.0, rel_tol=1e-6):
        return nodes, (f"the scores go through `{t.label}` but not as c * tanh(s / c) with one constant c (the fused "
                       "core's soft cap)")
    return nodes, outer


def _attention_at(g: Graph, sm: Node) -> Match | None:
    chain, terms, scale, cap = [sm], [], 1.0, None
    x = g.producer(sm)
    while x is not None and x.op == "add" and len(x.inputs) == 2 and len(terms) < 2:
        sides = _scores_side(g, *(g[i] for i in x.inputs))
        if sides is None:
            break
        chain.insert(0, x)
        terms.insert(0, sides[1])
        x = sides[0]
    if (capped := _cap_at(g, x)) is not None:
        nodes, cap = capped
        chain[:0] = nodes
        x = g.producer(nodes[0])
    scaled = x is not None and x.op in ("mul", "div") and len(x.inputs) == 1
    if scaled and (x.op == "mul" or isinstance(x.args[0], Ref)):
        c = next((a for a in x.args[:2] if not isinstance(a, Ref)), None)  # 0.125 * s or s * 0.125
        if c is not None and not isinstance(c, (int, float)):
            return None
        # None: computed from shapes in the code (fx sees the formula); the run-time trace knows its value
        scale = None if c is None else float(c) if x.op == "mul" else 1.0 / float(c)
        chain.insert(0, x)
        x = g.producer(x)
    if x is None or x.op != "matmul" or len(x.inputs) != 2:
        return None
    chain.insert(0, x)
    q, kt = g[x.inputs[0]], g[x.inputs[1]]
    m = Match("attention", chain, False, "", outputs=[])
    if isinstance(cap, str):
        m.reason = cap
        return m
    dim = sm.obj.dim if sm.obj is not None else arg(sm, 1, "dim", None)
    if dim not in (-1, None if sm.shape is None else len(sm.shape) - 1):
        m.reason = f"softmax over dim {dim}, not the last one"
        return m
    transposed = kt.op == "mT" or (kt.op == "transpose" and sorted(a for a in kt.args[1:3] if isinstance(a, int))
                                   in ([-2, -1], [2, 3]))
    if not transposed:
        m.reason = f"the key operand of `{x.label}` is `{kt.op}`, not a transpose of the last two dims"
        return m
    for a, b in zip(chain, chain[1:]):
        if reason := _consumer_reason(g, a, b):
            m.reason = reason
            return m
    tail, drop = sm, None
    nxt = g.only_user(sm)
    if nxt is not None and _cast_of(nxt, sm):  # softmax(..., dtype=float32).to(query.dtype): Llama's eager code
        chain.append(nxt)
        tail, nxt = nxt, g.only_user(nxt)
    if nxt is not None and nxt.op == "dropout":
        drop, tail = nxt, nxt
        chain.append(drop)
    pv = next((u for u in g.users.get(tail.name, []) if u.op == "matmul"), None)
    # the probabilities may also be what a region returns (eager attention code returns its weights beside the
    # output, and the layer calling it drops them): the fused op returns them too, for reading. Only in a region's
    # code: the run-time graph's match for the same chain, which must be viable for this one to be planned, sees
    # whether anything reads them after the region (returned by the model, a loss may use them: not fused)
    returned = pv is not None and g.region is not None and any(u.op == "output" for u in g.users.get(tail.name, []))
    if pv is not None and (reason := _consumer_reason(g, tail, pv)) and not (
            returned and all(u is pv or u.op == "output" for u in g.users.get(tail.name, []))):
        m.reason = reason
        return m
    if pv is None or pv.inputs[:1] != [tail.name]:
        users = ", ".join(f"`{u.label}`" for u in g.users.get(tail.name, []))
        m.reason = f"the attention probabilities go to {users or 'nothing'}, not straight into `@ v`"
        return m
    chain.append(pv)
    p = _dropout_module(drop).p if drop is not None else 0.0
    name_functional(g, drop, m)
    m.inputs = [q.name, kt.inputs[0], pv.inputs[1]] + [t.name for t in terms]  # mask, then a second term: bias
    m.outputs = [pv]
    m.params = {"scale": scale, "dropout_p": p, **m.params}
    if cap is not None:
        m.params["softcap"] = cap
    if sm.kwargs.get("dtype") is torch.float32:  # softmax(..., dtype=torch.float32): the op keeps that precision
        m.params["fp32_softmax"] = True
    if returned:
        m.outputs.append(tail)
        m.params["return_probs"] = True
    # eager code adds its mask to the scores (a bool one as 0 / 1); set with no mask too, so the code traced for a call
    # without one and for a call with one (a region's alternate) build the same op and share its stream
    m.params["mask_added"] = True
    m.reason = _op_support("FusedAttention", build=lambda: build_attention(m)) or _common_checks(g, chain)
    m.ok = not m.reason
    return m


def _cast_of(n: Node, sm: Node) -> bool:
    """``n`` is ``sm.to(dtype)`` with the dtype a constant or read from a tensor's metadata (``query.dtype``): the
    fused core takes the softmax with fp32 accumulation and gives the probabilities in the query's dtype, as the
    code does when it casts back."""
    if n.op != "to" or n.inputs != [sm.name]:
        return False
    rest = [*n.args[1:], *n.kwargs.values()] if n.args else []
    return all(a is None or isinstance(a, (torch.dtype, bool)) for a in rest)


# functional random calls make_reproducible draws as "<module path>:dropout.<i>" (consistency.functional)
_FUNCTIONAL_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d"})


def name_functional(g: Graph, drop: Node | None, m: Match) -> None:
    """An inline ``F.dropout`` the op absorbs: the stream ``make_reproducible`` keys that call by
    (``m.params["rng_name"]``), so the op draws that call's mask (Bart's activation dropout: 2e-2 apart unnamed)."""
    if drop is not None and drop.kind == "function":
        m.params["rng_name"] = functional_stream(g, drop)


def functional_stream(g: Graph, drop: Node) -> str:
    """The stream ``make_reproducible`` names an inline ``F.dropout`` call by: its module's path and its index
    among that module's functional dropouts (SDPA with dropout counts as one), so a fused op absorbing it draws
    the mask the unfused model draws there."""
    index = 0
    for n in g.nodes:
        if n is drop:
            break
        if n.kind == "function" and n.scope == drop.scope and (n.op in _FUNCTIONAL_DROPOUTS or (
                n.op == "scaled_dot_product_attention" and _sdpa_arg(n, "dropout_p", 0.0))):
            index += 1
    return f"{drop.scope or '<root>'}:dropout.{index}"


def build_qkv(m: Match, pack: bool = True) -> nn.Module:
    # pack=True moves the three weights into one buffer (values and Parameter identity kept): done on the
    # model apply() returns, never on the model being analysed (validation builds with pack=False).
    return op_class("FusedQKV").from_modules(m.params["q"], m.params["k"], m.params["v"], pack=pack,
                                             register=False)


def build_attention(m: Match) -> nn.Module:
    return op_class("FusedAttention")(scale=m.params["scale"], dropout_p=m.params["dropout_p"],
                                      return_probs=m.params.get("return_probs", False),
                                      is_causal=m.params.get("is_causal", False),
                                      enable_gqa=m.params.get("enable_gqa", False),
                                      fp32_softmax=m.params.get("fp32_softmax", False),
                                      mask_added=m.params.get("mask_added", False),
                                      softcap=m.params.get("softcap"))
