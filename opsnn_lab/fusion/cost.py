"""Cost model: activation bytes a fusion saves per training step, and memory traffic it avoids.

Both sides are counted the way ``opsnn_lab.bench.activation_bytes`` counts (unique storages autograd
saves, parameters left out), at the shapes seen on the example inputs:

* eager: the run-time trace attributes every saved storage to the node that saved it; the chain's share
  is what its nodes save that no node outside the chain saves too.
* fused: the op is built on the traced modules and run once on copies of the chain's real inputs under
  the same hooks; each saved storage is an input, an output or new, and inputs/outputs are mapped back
  to the model's storages (an op that saves its input costs nothing when the model saves that input
  anyway). One run per distinct (pattern, shapes, module config): BERT-base's 12 layers cost three.

saved = eager share - fused share, i.e. |outside U chain| - |outside U op| in unique bytes.

Traffic avoided (an estimate, not a measurement): every intermediate the chain no longer materialises is
written and read once in forward and once (as a gradient) in backward: 4 x its bytes. QKV instead reads
its input once instead of three times and accumulates one input gradient instead of three: 4 x input bytes.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from opsnn_lab.fusion.patterns import Match
from opsnn_lab.fusion.runtime import RuntimeTrace, _storage_key

__all__ = ["CostModel"]


class CostModel:
    def __init__(self, trace: RuntimeTrace, build):
        self.trace = trace
        self.build = build  # Match -> fused nn.Module
        self.cache: dict = {}
        self.by_node: dict[str, dict] = {}
        for node, key, nbytes in trace.saved:
            self.by_node.setdefault(node, {})[key] = nbytes
        self.saved_by: dict = {}  # storage key -> nodes that saved it
        for node, key, _ in trace.saved:
            self.saved_by.setdefault(key, set()).add(node)

    def _saved_outside(self, key, names: set) -> bool:
        return bool(self.saved_by.get(key, set()) - names)

    def eager_bytes(self, m: Match) -> int:
        """Bytes the chain's nodes save that nothing outside the chain saves too."""
        names = {n.name for n in m.nodes}
        own: dict = {}
        for n in names:
            own.update(self.by_node.get(n, {}))
        return sum(b for k, b in own.items() if not self._saved_outside(k, names))

    def fused_bytes(self, m: Match) -> int:
        """Bytes the op saves that nothing outside the chain saves too (its inputs and outputs included)."""
        sig = (m.pattern, tuple(self._signature(i) for i in m.inputs), tuple(map(str, m.params.values())))
        if sig not in self.cache:
            self.cache[sig] = self._measure(m)
        names = {n.name for n in m.nodes}
        roles = {("in", i): self.trace.storage_of(name) for i, name in enumerate(m.inputs)}
        roles.update({("out", j): self.trace.storage_of(o.name) for j, o in enumerate(m.outputs)})
        total, seen = 0, set()
        for role, nbytes in self.cache[sig]:
            key = roles.get(role, role)
            if key not in seen and not self._saved_outside(key, names):
                seen.add(key)
                total += nbytes
        return total

    def _signature(self, name: str):
        t = self.trace.tensors.get(name)
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)

    def _measure(self, m: Match) -> list[tuple[tuple, int]]:
        """Run the op once on copies of the chain's inputs; each saved storage as (role, bytes)."""
        # The op is built on copies of the chain's modules: building may repack weights (FusedQKV), and
        # the analysed model must not change.
        mods = copy.deepcopy({k: v for k, v in m.params.items() if isinstance(v, torch.nn.Module)})  # one memo:
        m = dataclasses.replace(m, params={**m.params, **mods})  # a module shared by two params stays shared
        op = self.build(m).train()
        xs = [self.trace.tensors[i].detach().clone().requires_grad_(self.trace.tensors[i].requires_grad)
              for i in m.inputs]
        params = {_storage_key(t) for mod in m.params.values() if isinstance(mod, torch.nn.Module)
                  for t in [*mod.parameters(), *mod.buffers()]} | {_storage_key(p) for p in op.parameters()}
        seen: dict = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = op(*xs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        roles = {_storage_key(x): ("in", i) for i, x in enumerate(xs)}
        roles.update({_storage_key(o): ("out", j) for j, o in enumerate(outs)})
        return [(roles.get(k, ("new", n)), b) for n, (k, b) in enumerate(seen.items()) if k not in params]

    def saved_bytes(self, m: Match) -> int:
        return self.eager_bytes(m) - self.fused_bytes(m)

    def traffic_bytes(self, m: Match) -> int:
        if m.pattern == "qkv":
            x = self.trace.graph.by_name.get(m.inputs[0])
            return 4 * (x.nbytes if x is not None else 0)
        outs = {o.name for o in m.outputs}
        return 4 * sum(n.nbytes for n in m.nodes if n.name not in outs)
