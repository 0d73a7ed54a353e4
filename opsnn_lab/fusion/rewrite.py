"""``apply``: rewrite a copy of the model so each fused decision calls its op.

Per region (a module fx traces; see regions.py) the forward is traced in train and in eval mode, the
planned chains are replaced by one call each (``replace_all_uses_with`` + ``erase_node``, then
``graph.lint()``), and the region's class is swapped for a subclass whose forward runs that code. The
region keeps every submodule at its qualified name, so ``state_dict`` keys and values are unchanged and
load both ways. The fused op sits in a ``FusedSlot``: it shares the original Parameters and registers
nothing, so it adds no state_dict key.
"""

from __future__ import annotations

import copy
import inspect
import operator

from torch import nn

from opsnn_lab._checks import check_type
from opsnn_lab.fusion.patterns import Match, find_all, pattern_of
from opsnn_lab.fusion.plan import FusionPlan
from opsnn_lab.fusion.regions import fx_graph, trace_region

__all__ = ["apply", "FusedSlot"]


class FusedSlot(nn.Module):
    """Calls a fused op whose parameters are registered elsewhere in the model (so: no state of its own)."""

    def __init__(self, op: nn.Module, pattern: str, modules: list[str]):
        super().__init__()
        object.__setattr__(self, "op", op)  # not a child: its Parameters already have their state_dict keys
        self.pattern, self.fused_modules = pattern, list(modules)

    def forward(self, *args):
        if self.op.training != self.training:  # the slot's flag is the one model.train()/eval() sets
            self.op.train(self.training)
        return self.op(*args)

    def _apply(self, fn, recurse=True):
        self.op._apply(fn)  # buffers the op holds itself follow .to()/.half(); shared ones are idempotent
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.pattern}: {', '.join(self.fused_modules)} -> {type(self.op).__name__}"


def _rewrite(gm, g, m: Match, slot: str, moved: dict) -> None:
    """Replace ``m``'s chain by one call of ``slot``; ``moved`` maps replaced fx nodes to their replacement."""
    graph = gm.graph
    chain = [n.ref for n in m.nodes]
    inputs = tuple(moved.get(g[name].ref, g[name].ref) for name in m.inputs)
    anchor = chain[0] if m.pattern == "qkv" else chain[-1]
    with graph.inserting_before(anchor):
        new = graph.call_module(slot, inputs)
        outs = [new] if len(m.outputs) == 1 else [graph.call_function(operator.getitem, (new, i))
                                                     for i in range(len(m.outputs))]
    for out, repl in zip(m.outputs, outs):
        out.ref.replace_all_uses_with(repl)
        moved[out.ref] = repl
    for node in reversed(chain):
        if not node.users:
            graph.erase_node(node)


def _guard(sig: inspect.Signature, concrete: dict):
    def ok(self, args, kwargs) -> bool:
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return all(type(bound.arguments.get(k)) is type(v) and bound.arguments.get(k) == v
                   for k, v in concrete.items())
    return ok


def _install(region: nn.Module, variants: dict, concrete: dict) -> None:
    cls = type(region)
    original = cls.forward
    guard = _guard(inspect.signature(original), concrete)

    def forward(self, *args, **kwargs):
        fn = variants.get(self.training)
        if fn is None or (concrete and not guard(self, args, kwargs)):
            fn = original  # a call the rewrite was not specialised for runs the original code
        return fn(self, *args, **kwargs)

    region.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                    "__qualname__": cls.__qualname__, "_unfused_class": cls})


def _rewrite_region(model: nn.Module, route: dict, keys: dict, slots: dict) -> int:
    path = route["path"]
    region = model.get_submodule(path) if path else model
    wrapped = [getattr(inspect.getmodule(type(region)), n) for n in route.get("wrapped", [])]
    variants, done = {}, 0
    for training in (True, False):
        gm, _ = trace_region(region, route["concrete"], training, wrapped)
        g, moved = fx_graph(gm, path), {}
        for m in find_all(g):
            if not (m.viable and m.key in keys):
                continue
            for k, v in keys[m.key].items():  # values fx sees only as formulas (a shape-derived scale)
                if m.params.get(k, v) is None:
                    m.params[k] = v
            if m.key not in slots:
                slots[m.key] = (f"fused_{m.pattern}_{len(slots)}", FusedSlot(pattern_of(m.pattern).build(m),
                                                                             m.pattern, m.modules))
                slots[m.key][1].train(region.training)
                region.add_module(*slots[m.key])
            name, slot = slots[m.key]
            gm.add_submodule(name, slot)
            _rewrite(gm, g, m, name, moved)
            done += training
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        variants[training] = type(gm).forward
    _install(region, variants, route["concrete"])
    return done


def apply(model: nn.Module, plan: FusionPlan) -> nn.Module:
    """A new module computing what ``model`` computes, with the plan's fused decisions rewritten.

    ``model`` is not modified. The result has the same ``state_dict`` keys and values.
    """
    check_type("model", model, nn.Module)
    check_type("plan", plan, FusionPlan)
    fused = copy.deepcopy(model)
    wanted = [d for d in plan.decisions if d.fused]
    by_region: dict[str, dict] = {}
    for d in wanted:
        by_region.setdefault(d.route.removeprefix("fx:"), {})[d.key] = d.params
    routes = {r["path"] or "<model>": r for r in plan.routes}
    slots: dict = {}
    for region, keys in by_region.items():
        if region not in routes:
            raise ValueError(f"plan routes have no region {region!r}; was the plan made for this model?")
        try:
            _rewrite_region(fused, routes[region], keys, slots)
        except Exception as exc:  # noqa: BLE001 - tracer errors have many types; say which plan failed
            raise ValueError(f"plan region {region!r} cannot be rewritten in this model ({type(exc).__name__}: "
                             f"{exc}); was the plan made for this model?") from exc
    missing = {d.key for d in wanted} - set(slots)
    if missing:
        raise ValueError(f"plan decisions not found in this model: {sorted(missing)[:3]}")
    if list(fused.state_dict()) != list(model.state_dict()):
        raise RuntimeError("fusion changed the state_dict keys; this is a bug in opsnn_lab.fusion")
    return fused
