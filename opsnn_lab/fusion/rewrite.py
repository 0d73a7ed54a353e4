"""``apply``: rewrite a copy of the model so each fused decision calls its op.

Decisions routed ``module:*`` are bound at module boundaries (patch.py: no tracer). Decisions routed
``fx:<region>`` (a functional chain inside one forward) use torch.fx on that region: its forward is traced
in train and in eval mode, the planned chains are replaced by one call each (``replace_all_uses_with`` +
``erase_node``, then ``graph.lint()``), and an ``FxForward`` bound on the instance runs that code with the
original signature (the class is never replaced). The region keeps every submodule at its qualified name,
so ``state_dict`` keys and values are unchanged and
load both ways. The fused op sits in a ``FusedSlot``: it shares the original Parameters and registers
nothing, so it adds no state_dict key.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from opsnn_lab._checks import check_type
from opsnn_lab.fusion import owners
from opsnn_lab.fusion.distributed import check_not_distributed
from opsnn_lab.fusion.graph import Graph, Node, Ref, canonical_module
from opsnn_lab.fusion.packing import RepackAfterApply, fused_ops, repack_after_load
from opsnn_lab.fusion.patch import install, revert
from opsnn_lab.fusion.patterns import Match, pattern_of
from opsnn_lab.fusion.plan import Decision, FusionPlan
from opsnn_lab.fusion.probe import probe_modules
from opsnn_lab.fusion.region_forward import FxForward
from opsnn_lab.fusion.region_rewrite import FusedSlot, name_stream, trace_variants
from opsnn_lab.fusion.regions import error_line, library_hooks
from opsnn_lab.fusion.routes import Route, inline_after, inline_view
from opsnn_lab.fusion.runtime import buffers_kept, graph_free_memo, own_dtypes

__all__ = ["apply", "FusedSlot", "FxForward", "revert", "REWRITE_FAILED"]

REWRITE_FAILED = "the fx rewrite of"  # how a decision whose region failed its rewrite starts (the sweep looks)


def _rewrite_region(model: nn.Module, route: dict, keys: dict, slots: dict) -> int:
    path = route["path"]
    region = model.get_submodule(path) if path else model
    variants, done = trace_variants(region, route, keys, slots)
    region.__dict__["forward"] = FxForward(region, variants, route["concrete"], path, route=route, keys=keys)
    return done


def _rebuild(model: nn.Module, d: Decision) -> Match:
    """The match of a module-level decision, found again on ``model``'s own modules (a plan from JSON)."""
    kind = d.route.removeprefix("module:")
    if kind not in ("chain", "qkv"):
        raise ValueError(f"decision {d.pattern} on {d.modules} ({d.route}) needs the analysis it came from; "
                         "call ol.fusion.analyze on this model again")
    try:
        mods = [model.get_submodule(p) for p in d.carriers]
    except AttributeError as exc:
        raise ValueError(f"plan decision {d.pattern} names modules missing here ({exc}); "
                         "was the plan made for this model?") from exc
    nodes, prev = [Node("x", "input", "input")], "x"
    after = inline_after(d.chain, d.carriers) or ("",) * len(mods)
    ops = [op for label, op in zip(d.chain, d.ops) if label in d.carriers] if len(d.ops) == len(d.chain) else []
    ops = ops if len(ops) == len(mods) else [canonical_module(mod) for mod in mods]
    for i, (path, mod, op, inline) in enumerate(zip(d.carriers, mods, ops, after)):
        if inline:  # an inline dropout with p=0 (routes.inline_identity) or a view between two steps
            scope, _, step = inline.rpartition(".")
            if inline_view(inline):
                args = (Ref(prev), slice(None)) if step == "getitem" else (Ref(prev),)
            else:
                step, args = "dropout", (Ref(prev), 0.0)
            nodes.append(Node(f"i{i}", "function", step, [prev], args, scope=scope))
            prev = f"i{i}"
        nodes.append(Node(f"n{i}", "module", op, [prev], (Ref(prev),), module=path, obj=mod))
        prev = prev if kind == "qkv" else f"n{i}"
    nodes.append(Node("out", "output", "output", [n.name for n in nodes[1:]] if kind == "qkv" else [prev]))
    found = [m for m in pattern_of(d.pattern).find(Graph(nodes))
             if m.ok and m.pattern == d.pattern and [n.module for n in m.nodes if n.kind == "module"] == [*d.carriers]]
    if not found:
        raise ValueError(f"plan decision {d.pattern} on {d.modules} does not match these modules; "
                         "was the plan made for this model?")
    return found[0]


def _copy_memo(model: nn.Module, fused: nn.Module) -> dict:
    """The analysed model's modules, Parameters and buffers -> their copies (before anything is added)."""
    memo: dict = {}
    for getter in (nn.Module.modules, nn.Module.parameters, nn.Module.buffers):
        for a, b in zip(getter(model), getter(fused)):
            memo[id(a)] = b
    return memo


def _module_rewrites(model: nn.Module, fused: nn.Module, plan: FusionPlan, decisions: list[Decision],
                     memo: dict) -> None:
    analysis = plan._analysis if plan._analysis is not None and plan._analysis.model is model else None
    done = set()
    for d in decisions:
        if (d.key, d.route, tuple(d.carriers)) in done:
            continue  # a module called more than once: its one patch computes the chain at each call
        done.add((d.key, d.route, tuple(d.carriers)))
        if analysis is not None and d.key in analysis.matches:
            m = analysis.matches[d.key]
            owners = [v for v in m.params.values() if isinstance(v, nn.Module)]
            m = dataclasses.replace(m, params=copy.deepcopy(m.params, {**graph_free_memo(*owners), **memo}))
        else:
            m = _rebuild(fused, d)
        with torch.random.fork_rng(devices=[]):
            op = name_stream(pattern_of(m.pattern).build(m), m)
        try:
            install(fused, Route(d.route.removeprefix("module:"), tuple(d.carriers), d.first,
                                 inline_after(d.chain, d.carriers)), op, d.pattern)
        except AttributeError as exc:
            raise ValueError(f"plan decision {d.pattern} names modules missing here ({exc}); "
                             "was the plan made for this model?") from exc


def _leave_unfused(fused: nn.Module, plan: FusionPlan, route: dict, slots: dict, before: set,
                   exc: Exception) -> None:
    """A region the analysis of this very model traced but whose rewrite failed: its chains run unfused (the fused
    ops registered for it are removed), the plan's decisions and total say so, and a warning names the error."""
    host = fused.get_submodule(route["path"]) if route["path"] else fused
    for key in set(slots) - before:
        name, _ = slots.pop(key)
        del host._modules[name]
    region = route["path"] or "<model>"
    why = f"{REWRITE_FAILED} `{region}` failed ({type(exc).__name__}: {error_line(exc)[:200]}); its chains run unfused"
    for d in plan.decisions:
        if d.fused and d.route == f"fx:{region}":
            d.fused, d.reason, d.route = False, why, ""
    plan.saved_together = plan._analysis.saved_together(plan.decisions)
    warnings.warn(f"opsnn_lab.fusion: {why} (a bug in opsnn_lab: please report it with the model)", RuntimeWarning,
                  stacklevel=3)


def apply(model: nn.Module, plan: FusionPlan) -> nn.Module:
    """A new module computing what ``model`` computes, with the plan's fused decisions rewritten.

    ``model`` is not modified. The result has the same ``state_dict`` keys and values, the same forward
    signature, and each rewritten module keeps its class (see patch.py; ``revert`` undoes the patches).
    A plan from another model (JSON) that does not fit raises ``ValueError``; with the plan the analysis of
    ``model`` made, an fx region whose rewrite fails runs unfused, with a warning, and ``plan`` says so.
    """
    check_type("model", model, nn.Module)
    check_type("plan", plan, FusionPlan)
    check_not_distributed(model)
    fused = copy.deepcopy(model, graph_free_memo(model))
    # probing and tracing run the copy's code, which may move a buffer (a spectral norm's power iteration): each
    # is put back as the model has it
    put_back = buffers_kept(fused)
    with own_dtypes(fused):  # the copy's own Linear subclasses and activations, as analysis found the model's
        probe_modules(fused)
    memo = _copy_memo(model, fused)  # the op of a module-level decision shares the copy's Parameters
    wanted = [d for d in plan.decisions if d.fused]
    # Module-level patches first: an fx region traced afterwards keeps each patched module as one call.
    _module_rewrites(model, fused, plan, [d for d in wanted if d.route.startswith("module:")], memo)
    by_region: dict[str, dict] = {}
    for d in wanted:
        if d.route.startswith("fx:"):
            by_region.setdefault(d.route.removeprefix("fx:"), {})[d.key] = d.params
    routes = {r["path"] or "<model>": r for r in plan.routes}
    slots: dict = {}
    analysed_here = plan._analysis is not None and plan._analysis.model is model
    with library_hooks(fused):  # as the analysis traced the regions
        for region, keys in by_region.items():
            if region not in routes:
                raise ValueError(f"plan routes have no region {region!r}; was the plan made for this model?")
            before = set(slots)
            try:
                _rewrite_region(fused, routes[region], keys, slots)
            except Exception as exc:  # noqa: BLE001 - tracer errors have many types; say which plan failed
                if not analysed_here:
                    raise ValueError(f"plan region {region!r} cannot be rewritten in this model "
                                     f"({type(exc).__name__}: {exc}); was the plan made for this model?") from exc
                _leave_unfused(fused, plan, routes[region], slots, before, exc)
    missing = {d.key for d in plan.decisions if d.fused and d.route.startswith("fx:")} - {k for k, _ in slots}
    if missing:
        raise ValueError(f"plan decisions not found in this model: {sorted(missing)[:3]}")
    if list(fused.state_dict()) != list(model.state_dict()):
        raise RuntimeError("fusion changed the state_dict keys; this is a bug in opsnn_lab.fusion")
    from opsnn_lab.consistency.streams import name_hosts

    name_hosts(fused)  # a fused op's absorbed stream, named in ``fused``, is found from a model that wraps it
    put_back()
    ops = fused_ops(fused)
    owners.link(fused, ops)  # each op reads what its modules hold at each call (functional_call, a new Parameter)
    if any(hasattr(op, "repack") for op in ops):  # packed weights: packed again after .to()/.half(), a load
        fused.__dict__["_apply"] = RepackAfterApply(fused)
        fused.register_load_state_dict_post_hook(repack_after_load)
    return fused
