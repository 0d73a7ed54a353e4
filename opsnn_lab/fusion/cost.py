"""Cost model: activation bytes a fusion saves per training step, and memory traffic it avoids.

Both sides are counted the way ``opsnn_lab.bench.activation_bytes`` counts (unique storages autograd
saves, parameters left out), at the shapes seen on the example inputs:

* eager: the run-time trace attributes every saved storage to the node that saved it; the chain's share
  is what its nodes save minus the chain's inputs (saved by whoever produced them anyway) and minus
  storages that code outside the chain saves too.
* fused: the op is built on the traced modules and run once on copies of the chain's real inputs under
  the same hooks. One measurement per distinct (pattern, shapes, module config): the 12 layers of a
  BERT-base encoder cost three runs, not thirty-six.

Traffic avoided (an estimate, not a measurement): every intermediate the chain no longer materialises is
written and read once in forward and once (as a gradient) in backward: 4 x its bytes. QKV instead reads
its input once instead of three times and accumulates one input gradient instead of three: 4 x input bytes.
"""

from __future__ import annotations

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

    def _inputs(self, m: Match) -> set:
        return {self.trace.storage_of(i) for i in m.inputs} - {None}

    def _outside_outputs(self, m: Match, names: set) -> set:
        """Output storages that nodes outside the chain save anyway (no saving or cost either way)."""
        keys = {self.trace.storage_of(o.name) for o in m.outputs} - {None}
        return {k for k in keys if self.saved_by.get(k, set()) - names}

    def eager_bytes(self, m: Match) -> int:
        names = {n.name for n in m.nodes}
        skip = self._inputs(m)
        own: dict = {}
        for n in names:
            own.update(self.by_node.get(n, {}))
        return sum(b for k, b in own.items() if k not in skip and not (self.saved_by.get(k, set()) - names))

    def fused_bytes(self, m: Match) -> int:
        sig = (m.pattern, tuple(self._signature(i) for i in m.inputs), tuple(map(str, m.params.values())),
               bool(self._outside_outputs(m, {n.name for n in m.nodes})))
        if sig not in self.cache:
            self.cache[sig] = self._measure(m, sig[-1])
        return self.cache[sig]

    def _signature(self, name: str):
        t = self.trace.tensors.get(name)
        return None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)

    def _measure(self, m: Match, output_saved_outside: bool) -> int:
        op = self.build(m).train()
        xs = [self.trace.tensors[i].detach().clone().requires_grad_(self.trace.tensors[i].requires_grad)
              for i in m.inputs]
        skip = {_storage_key(x) for x in xs}
        skip |= {_storage_key(t) for mod in m.params.values() if isinstance(mod, torch.nn.Module)
                 for t in [*mod.parameters(), *mod.buffers()]}
        skip |= {_storage_key(p) for p in op.parameters()}
        seen: dict = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = op(*xs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        if output_saved_outside:
            skip |= {_storage_key(o) for o in outs}
        return sum(b for k, b in seen.items() if k not in skip)

    def saved_bytes(self, m: Match) -> int:
        return self.eager_bytes(m) - self.fused_bytes(m)

    def traffic_bytes(self, m: Match) -> int:
        if m.pattern == "qkv":
            x = self.trace.graph.by_name.get(m.inputs[0])
            return 4 * (x.nbytes if x is not None else 0)
        outs = {o.name for o in m.outputs}
        return 4 * sum(n.nbytes for n in m.nodes if n.name not in outs)
