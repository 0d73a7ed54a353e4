"""A fused op reads the Parameters and buffers its modules hold at the moment it runs.

Some fused ops register the replaced modules' Parameter objects on themselves (the Linear -> activation ops, the
norms, the head + loss: ops that can also be built from tensors alone); the others read their modules at each call.
A tensor put in a module's place after fusion would not reach the first kind: ``torch.func.functional_call``'s
tensors, a new ``nn.Parameter`` assigned (tying, resizing, a reset), ``load_state_dict(..., assign=True)`` (the
low-memory load of a model built on the meta device), a loader that assigns Parameters of its own, FSDP2's
unsharded Parameters at every forward, FSDP1's views of its flat Parameter (plain tensor attributes where the
Parameters were). Such calls ran unfused until now, or, before the staleness check, computed with the old tensors.

``link(model)`` (at fusion) records, for each such op, which module of the model holds each of its tensors;
``call(op, *args)`` points the op at what those modules hold now and runs it. A Parameter stays linked (the op
holds what the model holds); any other tensor (``functional_call``'s, maybe a non-leaf tensor with a graph) only for
that call, so the op keeps no tensor of the caller's past it (``copy.deepcopy`` refuses a non-leaf tensor). A
tensor of another shape than at fusion makes the chain run unfused (``staleness.changed``): the op, and a region's
traced code, were made for that shape.
"""

from __future__ import annotations

from torch import nn

__all__ = ["link", "call", "LINKS"]

LINKS = "_opsnn_owner_links"  # on the op's __dict__: ((module, table, name, owner, owner's name), ...)
_TABLES = ("_parameters", "_buffers")


def link(model: nn.Module, ops) -> int:
    """Record on each of ``ops`` (fused ops of ``model``, outside its module tree) the owner of every tensor it
    registers: the module of ``model`` that holds the same object, under which name. Returns the number of links."""
    owners = {}
    for module in model.modules():
        for table in _TABLES:
            for name, t in module.__dict__[table].items():
                if t is not None:
                    owners.setdefault(id(t), (table, module, name))
    tree, count = set(model.modules()), 0
    for op in ops:
        links = []
        for sub in op.modules():
            if sub in tree:  # a module of the model itself (FusedQKV's registered Linears): read as it is
                continue
            for table in _TABLES:
                for name, t in sub.__dict__[table].items():
                    owner = owners.get(id(t)) if t is not None else None
                    if owner is not None and owner[0] == table:
                        links.append((sub, table, name, owner[1], owner[2]))
        if links:
            op.__dict__[LINKS] = tuple(links)
            count += len(links)
    return count


def call(op: nn.Module, *args, run=None):
    """``op(*args)`` (or ``run(*args)``: another read of the op's tensors) with each linked tensor read from its
    owner first (~0.2 us a link). A Parameter its owner no longer holds at all, a plain tensor attribute in its
    place (FSDP1's views of its flat Parameter, which it set where it deleted the Parameters), is not kept after
    the call: the op would hold the whole unsharded weight alive on every rank."""
    run = op if run is None else run
    links = op.__dict__.get(LINKS)
    if not links:
        return run(*args)
    lent = None
    for sub, table, name, owner, owned in links:
        held, now = sub.__dict__[table], owner.__dict__[table].get(owned)
        dropped = now is None
        if dropped:
            now = owner.__dict__.get(owned)
        before = held.get(name)
        if now is before or now is None:  # None: gone from its owner, which the staleness check sees first
            continue
        held[name] = now
        if not isinstance(now, nn.Parameter) and table == "_parameters":
            lent = [] if lent is None else lent
            lent.append((held, name, None if dropped else before))
    if lent is None:
        return run(*args)
    try:
        return run(*args)
    finally:
        for held, name, before in lent:
            held[name] = before
