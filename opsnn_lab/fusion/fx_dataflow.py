"""An fx GraphModule as opsnn_lab's dataflow graph (``graph.Graph``): the form the pattern finders read, with
names qualified from the model's root. Shape arithmetic (``x.size(-1)``, ``x.shape``) is metadata, not nodes."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from opsnn_lab.fusion.graph import Graph, Node, Ref, canonical_function, canonical_module
from opsnn_lab.fusion.specialise import GUARDS, PY_MODULES

__all__ = ["fx_graph"]

_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "T", "mT"}
_META_METHODS = {"size", "dim", "numel", "type", "stride", "is_contiguous", "get_device"}


def _is_meta(n: fx.Node, meta: set) -> bool:
    if n.op == "call_function" and n.target is getattr:
        return n.args[1] in _META_ATTRS - {"T", "mT"}
    if n.op == "call_method" and n.target in _META_METHODS:
        return True
    if n.op == "call_function" and getattr(n.target, "__module__", None) in PY_MODULES:
        deps = n.all_input_nodes
        return bool(deps) and all(a.name in meta for a in deps)
    if n.op == "call_function" and (getattr(n.target, "__name__", "") == "_assert_is_none" or n.target in GUARDS):
        return True
    return False


def _scope(n: fx.Node, prefix: str, module_node: bool) -> str:
    stack = list((n.meta.get("nn_module_stack") or {}).values())
    if module_node:
        stack = stack[:-1]
    inner = stack[-1][0] if stack else ""
    return ".".join(p for p in (prefix, inner) if p)


def fx_graph(gm: fx.GraphModule, prefix: str, root: nn.Module | None = None) -> Graph:
    """The dataflow graph of an fx GraphModule, names qualified from the model's root. ``root``, the module that
    was traced, gives the graph its modules by path: a norm written in Python is inlined by fx, and its finder
    needs the module its ops ran in (with the verdict the run-time record reached, ``Graph.memo``)."""
    nodes, meta = [], set()

    def ref(a):
        return fx.node.map_arg(a, lambda x: Ref(x.name) if x.name not in meta else None)

    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and _is_meta(n, meta):
            meta.add(n.name)
            continue
        ins = [a.name for a in n.all_input_nodes if a.name not in meta]
        if n.op in ("placeholder", "get_attr"):
            node = Node(n.name, "input", "input" if n.op == "placeholder" else "param")
        elif n.op == "call_module":
            mod = gm.get_submodule(n.target)
            qual = f"{prefix}.{n.target}" if prefix else n.target
            node = Node(n.name, "module", canonical_module(mod), ins, ref(n.args), ref(dict(n.kwargs)), module=qual,
                        scope=_scope(n, prefix, True), obj=mod)
        elif n.op == "output":
            node = Node(n.name, "output", "output", [x.name for x in _tensor_nodes(n.args[0]) if x.name not in meta])
        else:
            op = n.args[1] if n.target is getattr and n.args[1] in ("T", "mT") else canonical_function(n.target)
            node = Node(n.name, "function", op, ins, ref(n.args), ref(dict(n.kwargs)), scope=_scope(n, prefix, False))
        node.ref = n
        nodes.append(node)
    g = Graph(nodes)
    g.region = prefix
    if root is not None:
        g.modules = {".".join(p for p in (prefix, name) if p): m for name, m in root.named_modules()}
    return g


def _tensor_nodes(value) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append) if not _is_dataclass_like(value) else [
        fx.node.map_arg(v, out.append) for v in vars(value).values()]
    return out


def _is_dataclass_like(value) -> bool:
    return hasattr(value, "__dataclass_fields__")
