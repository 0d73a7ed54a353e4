"""Cost model: activation bytes a fusion saves per training step, and memory traffic it avoids.

Both sides are counted the way ``opsnn_lab.bench.activation_bytes`` counts (unique storages autograd
saves, parameters left out), at the shapes seen on the example inputs:

* eager: the run-time trace attributes every saved storage to the node that saved it; the chain's share
  is what its nodes save that no node outside the chain saves too.
* fused: the op is built on the traced modules and run once on copies of the chain's real inputs under
  the same hooks; each saved storage is an input, an output or new, and inputs/outputs are mapped back
  to the model's storages (an op that saves its input costs nothing when the model saves that input
  anyway). One run per distinct (pattern, shapes, module config): BERT-base's 12 layers cost three.

saved = eager share - fused share, i.e. |outside U chain| - |outside' U op| in unique bytes, where outside' is
what the rest of the model saves once the op runs: the same tensors, but a saved view of a chain output now
views the op's output storage. Where the op returns its outputs as views of one buffer (FusedQKV: q, k and v
are column slices of one GEMM result), a consumer saving any of them (SDPA saves v; a hand-written attention
saves v for ``p @ v``) keeps the whole buffer alive: the op's share counts that buffer, less the eager output
storages those consumers kept before. For an op returning storages of eager's sizes the two cancel. The shape
ops after an output are replayed on the op's output layout: where eager's copied (a transpose + reshape of a
contiguous attention output) and the op's is a view, the copy's storage is the op's output storage too.

Savings of several chains do not add up where they share storages: two LayerNorms reading one tensor each
save it, so fusing either alone frees nothing of it and fusing both frees it; a chain whose outputs a fused
norm reads no longer has them kept alive by an eager norm. ``fused_total`` counts the model with a set of chains
rewritten together, from what each site recorded (``site``): the plan's total is that, exactly.

Traffic avoided (an estimate, not a measurement): every intermediate the chain no longer materialises is
written and read once in forward and once (as a gradient) in backward: 4 x its bytes. QKV instead reads
its input once instead of three times and accumulates one input gradient instead of three: 4 x input bytes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from opsnn_lab.fusion.graph import Ref
from opsnn_lab.fusion.patterns import Match
from opsnn_lab.fusion.runtime import RuntimeTrace, _storage_key, graph_free_memo
from opsnn_lab.measuring import pack_detached

__all__ = ["CostModel"]


@dataclass
class SiteCost:
    """What one call site of a chain needs to be counted with others after the trace's tensors are released."""

    nodes: frozenset  # the chain's node names
    ins: list  # (model storage key, its bytes) of each input
    moved: dict  # eager storage -> the op's output storage (group) holding that tensor once the op runs
    saved: list  # the op's saved storages, as (role, bytes) (CostModel._measure)
    out_storages: dict  # group -> bytes of the op's output storages
    # (outside node, eager storage) -> (the copy it saves instead, its bytes): a view in eager, a copy in the op's
    # output layout (``CostModel._moved``)
    copied: dict = dataclasses.field(default_factory=dict)


class CostModel:
    def __init__(self, trace: RuntimeTrace, build):
        self.trace = trace
        self.build = build  # Match -> fused nn.Module
        self.cache: dict = {}
        self.sites: dict[tuple, SiteCost] = {}  # (match key, node names) -> what fused_total needs
        self.by_node: dict[str, dict] = {}
        for node, key, nbytes in trace.saved:
            self.by_node.setdefault(node, {})[key] = nbytes
        self.saved_by: dict = {}  # storage key -> nodes that saved it
        self.nbytes: dict = {}  # storage key -> bytes
        for node, key, nbytes in trace.saved:
            self.saved_by.setdefault(key, set()).add(node)
            self.nbytes[key] = nbytes

    def _saved_outside(self, key, names: set) -> bool:
        return bool(self.saved_by.get(key, set()) - names)

    def eager_bytes(self, m: Match) -> int:
        """Bytes the chain's nodes save that nothing outside the chain saves too."""
        names = {n.name for n in m.nodes}
        own: dict = {}
        for n in names:
            own.update(self.by_node.get(n, {}))
        return sum(b for k, b in own.items() if not self._saved_outside(k, names))

    def fused_bytes(self, m: Match, moved: dict, copied: dict) -> int:
        """Bytes the op saves that nothing outside the chain saves too (its inputs and outputs included), plus the
        growth of what outside nodes keep alive through views of its outputs (see the module docstring); ``moved``,
        ``copied``: ``_moved``'s for this site."""
        saved, out_storages, _ = self._entry(m)
        names = {n.name for n in m.nodes}
        ins = {("in", i): self.trace.storage_of(name) for i, name in enumerate(m.inputs)}
        held: dict = {}  # key -> bytes: model storages for the op's inputs, the op's own ("out", g) / ("new", n)
        for role, nbytes in saved:
            key = ins.get(role, role)
            if role[0] != "in" or not self._saved_outside(key, names):
                held.setdefault(key, nbytes)
        kept_before: dict = {}  # eager storages outside nodes saved that are the op's output storage once it runs
        for key, group in moved.items():
            for node in self.saved_by.get(key, set()) - names:
                kept_before[key] = self.nbytes[key]
                held.setdefault(*copied.get((node, key), (("out", group), dict(out_storages)[group])))
        return sum(held.values()) - sum(kept_before.values())

    def _entry(self, m: Match):
        sig = (m.pattern, tuple(self._signature(i) for i in m.inputs),  # a stream's name changes no byte
               tuple(str(v) for k, v in m.params.items() if k != "rng_name"))
        if sig not in self.cache:
            self.cache[sig] = self._measure(m)
        return self.cache[sig]

    def _moved(self, m: Match, out_storages: list, layouts: list, own_code: bool = False) -> tuple[dict, dict]:
        """Eager storage -> the op output storage (group) that holds that tensor once the op runs: each output's,
        and those of the shape ops after it that copied in eager but view the op's output (the attention op's
        output is laid out (B, T, heads, d): ``o.transpose(1, 2).reshape(B, T, -1)`` copied eager's, not the op's).
        And the other way, (outside node, eager storage) -> (the copy it saves instead, bytes) for a node saving
        what a shape op viewed in eager and copies in the op's layout: Longformer's ``reshape(B * heads, T, d)`` of a
        query the packed QKV output holds beside the key and value (its einsum then keeps that copy, not the packed
        output). ``own_code``: the model's own code runs around the op (a module-level route), so an op writing into
        its output in place (Longformer's ``query /= sqrt(d)``) leaves it where it is; fx code computes an augmented
        assignment out of place (Nystromformer's ``context += conv(v)``), so the walk stops there."""
        moved, copied, names = {}, {}, {n.name for n in m.nodes}
        for o, (group, _), layout in zip(m.outputs, out_storages, layouts):
            key = self.trace.storage_of(o.name)
            if key is None:
                continue
            moved[key] = group
            shape, stride, offset, numel, dtype = layout
            base = torch.empty(numel, dtype=dtype)
            todo = [(o, base.as_strided(shape, stride, offset))]
            while todo:
                n, t = todo.pop()
                for u in self.trace.graph.users.get(n.name, []):
                    v = t if own_code and u.inplace and u.inputs[:1] == [n.name] else _replay_view(u, n, t)
                    if u.name in names or v is None:
                        continue  # not a shape op
                    if v.untyped_storage().data_ptr() != base.data_ptr():  # a copy with the op's output
                        if self.trace.storage_of(u.name) == key:  # but a view in eager
                            copied.update(self._copy_savers(u, key))
                        continue
                    if self.trace.storage_of(u.name) not in (None, key):
                        moved.setdefault(self.trace.storage_of(u.name), group)  # a copy in eager only
                    todo.append((u, v))
        return moved, copied

    def _copy_savers(self, u, key) -> dict:
        """(node, ``key``) -> (("copy", u), bytes of ``u``) for the nodes saving ``key`` through what ``u`` (a view of
        ``key`` in eager, a copy of the op's output) and the views after it make, and through nothing else."""
        seen, todo = {u.name}, [u.name]
        while todo:  # the eager views of key made from u
            for w in self.trace.graph.users.get(todo.pop(), []):
                if w.name not in seen and self.trace.storage_of(w.name) == key:
                    seen.add(w.name)
                    todo.append(w.name)
        t = self.trace.tensors.get(u.name)
        nbytes = t.numel() * t.element_size() if t is not None else 0
        out = {}
        for node in self.saved_by.get(key, set()):
            n = self.trace.graph.by_name.get(node)
            reads = [i for i in (n.inputs if n is not None else []) if self.trace.storage_of(i) == key]
            if reads and all(i in seen for i in reads):
                out[(node, key)] = (("copy", u.name), nbytes)
        return out

    def _signature(self, name: str):
        t = self.trace.tensors.get(name)
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)

    def _measure(self, m: Match) -> tuple[list, list, list]:
        """Run the op once on copies of the chain's inputs: each saved storage as (role, bytes); each output's
        storage as (group, bytes), outputs sharing one storage sharing a group (their role is ("out", group)); each
        output's layout (shape, stride, offset, storage elements, dtype)."""
        # The op is built on copies of the chain's modules: building may repack weights (FusedQKV), and
        # the analysed model must not change.
        mods = {k: v for k, v in m.params.items() if isinstance(v, torch.nn.Module)}
        mods = copy.deepcopy(mods, graph_free_memo(*mods.values()))  # one memo:
        m = dataclasses.replace(m, params={**m.params, **mods})  # a module shared by two params stays shared
        op = self.build(m).train()
        xs = [_copy_of(self.trace.tensors[i]) for i in m.inputs]
        params = {_storage_key(t) for mod in m.params.values() if isinstance(mod, torch.nn.Module)
                  for t in [*mod.parameters(), *mod.buffers()]} | {_storage_key(p) for p in op.parameters()}
        seen: dict = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
            return pack_detached(t)  # not t: no cycle through the graph (measuring.pack_detached)

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = op(*xs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        roles = {_storage_key(x): ("in", i) for i, x in enumerate(xs)}
        groups = [next(i for i, p in enumerate(outs) if _storage_key(p) == _storage_key(o)) for o in outs]
        roles.update({_storage_key(o): ("out", g) for o, g in zip(outs, groups)})
        saved = [(roles.get(k, ("new", n)), b) for n, (k, b) in enumerate(seen.items()) if k not in params]
        layouts = [(tuple(o.shape), o.stride(), o.storage_offset(), o.untyped_storage().nbytes() // o.element_size(),
                    o.dtype) for o in outs]
        return saved, [(g, o.untyped_storage().nbytes()) for o, g in zip(outs, groups)], layouts

    def site(self, m: Match, own_code: bool = False) -> tuple[int, int, int]:
        """``(saved, traffic, eager)`` bytes of one call site, kept for ``fused_total`` (while the tensors exist)."""
        saved, out_storages, layouts = self._entry(m)
        moved, copied = self._moved(m, out_storages, layouts, own_code)
        eager = self.eager_bytes(m)
        costs = eager - self.fused_bytes(m, moved, copied), self.traffic_bytes(m), eager
        ins = []
        for name in m.inputs:
            t = self.trace.tensors.get(name)
            ins.append((self.trace.storage_of(name), t.untyped_storage().nbytes() if t is not None else 0))
        self.sites[(m.key, tuple(n.name for n in m.nodes))] = SiteCost(
            frozenset(n.name for n in m.nodes), ins, moved, saved, dict(out_storages), copied)
        return costs

    def fused_total(self, sites, dropped=frozenset()) -> int:
        """Activation bytes of the model with the chains at ``sites`` (keys of ``self.sites``) rewritten together:
        the nodes outside them save what they saved, a view of a chain output now viewing the op's output storage;
        each op saves what it saved when measured, its inputs being the model's (or another op's output).
        ``dropped``: nodes whose saves nothing keeps (inside a checkpointed layer: ``checkpointing``)."""
        recs = [self.sites[s] for s in sites]
        inside = frozenset().union(*(r.nodes for r in recs))
        moved = {}  # eager output storage -> (the op's output storage, its bytes)
        copied = {}  # (outside node, eager storage) -> (the copy it saves instead, its bytes)
        for k, r in enumerate(recs):
            for key, group in r.moved.items():
                moved[key] = (("op", k, "out", group), r.out_storages[group])
            copied.update({site: (("op", k, *copy), nbytes) for site, (copy, nbytes) in r.copied.items()})
        held: dict = {}
        for node, key, nbytes in self.trace.saved:
            if node not in inside and node not in dropped:
                held.setdefault(*copied.get((node, key)) or moved.get(key, (key, nbytes)))
        for k, r in enumerate(recs):
            for role, nbytes in r.saved:
                if role[0] == "in":
                    key, model_bytes = r.ins[role[1]]
                    held.setdefault(*moved.get(key, (key, model_bytes or nbytes)))
                else:
                    held.setdefault(("op", k, *role), nbytes)
        return sum(held.values())

    def traffic_bytes(self, m: Match) -> int:
        if m.pattern == "qkv":
            x = self.trace.graph.by_name.get(m.inputs[0])
            return 4 * (x.nbytes if x is not None else 0)
        outs = {o.name for o in m.outputs} | set(m.views)  # a view moves no bytes
        return 4 * sum(n.nbytes for n in m.nodes if n.name not in outs)


def _copy_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (a broadcast dimension stays one), so the op takes the path it takes in the
    model: an attention core reading ``v`` as a strided view of the QKV output copies it there and keeps the
    copy, where a contiguous clone would be kept as it is (and counted as that whole output)."""
    grad, t = t.requires_grad, t.detach()
    try:
        base = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
        copy = torch.empty_strided(base.shape, base.stride(), dtype=t.dtype, device=t.device).copy_(base)
        copy = copy.expand(t.shape)
    except RuntimeError:  # strides that overlap otherwise: a dense copy
        copy = t.clone()
    return copy.requires_grad_(grad)


# Shape ops whose result may be a view of their input or a copy, depending on its strides.
_SHAPE_OPS = frozenset({"view", "reshape", "transpose", "permute", "flatten", "unflatten", "contiguous", "squeeze",
                        "unsqueeze", "t", "narrow", "view_as", "reshape_as", "swapaxes", "movedim"})


def _replay_view(u, n, t: torch.Tensor) -> torch.Tensor | None:
    """``u`` (a shape op reading only ``n``'s tensor, recorded with constant arguments) run on ``t``; else None."""
    if u.op not in _SHAPE_OPS or u.inputs != [n.name] or not u.args or u.args[0] != Ref(n.name):
        return None
    rest = [*u.args[1:], *u.kwargs.values()]
    if any(isinstance(a, (Ref, str, torch.Tensor)) for a in rest):
        return None
    try:
        return getattr(torch.Tensor, u.op)(t, *u.args[1:], **u.kwargs)
    except (RuntimeError, TypeError, AttributeError):
        return None
