"""Where torch.fx can rewrite: the whole model if it traces, else the largest submodules that do.

Each module the example call ran is traced (``tracer.trace_region``: helpers kept opaque, arguments specialised,
the example's tensor ranks, a forward wrapper left out where it passes the call through, children fx cannot trace
kept as calls); when it still fails, its children are tried, and the reason is kept for the plan. A forward traced
without its wrapper is replayed to check the wrapper (``wrappers.passes_through``), once per class and flags, and
only where the region's code holds a chain that needs fx.

A module whose forward runs its children in turn (``nn.Sequential``, or any forward looping over
``self.children()``) is not a region even when it traces: the rewrite registers each fused op as a child of
its region (``rewrite.FusedSlot``), which there would become one more step. Its children are tried instead.
"""

from __future__ import annotations

import functools
import inspect
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from opsnn_lab._hooks import has_hooks
from opsnn_lab.fusion.fx_dataflow import fx_graph
from opsnn_lab.fusion.graph import Graph, is_leaf_module
from opsnn_lab.fusion.instance import instance_state, restore_instance_state
from opsnn_lab.fusion.specialise import check_guards
from opsnn_lab.fusion.tracer import kwargs_values, library_hooks, trace_region
from opsnn_lab.fusion.wrappers import forward_wrapper, holds_tensors, passes_through

__all__ = ["Region", "find_regions", "trace_region", "fx_graph", "bind_call", "error_line", "concrete_args",
           "tensor_facts", "facts_hold", "library_hooks"]

_SCALARS = (type(None), bool, int, float, str)


@dataclass
class Region:
    path: str
    route: str  # "fx" | "untraceable" | "container" (it runs its children in turn: they are the regions)
    reason: str = ""  # why torch.fx failed here ('' for fx regions)
    concrete: dict = field(default_factory=dict)  # specialised non-tensor arguments
    wrapped: list[str] = field(default_factory=list)  # helper functions kept opaque
    graph: Graph | None = field(default=None, repr=False)
    tensors: dict = field(default_factory=dict)  # the example's tensor facts, when tracing needed them
    unwrapped: str = ""  # the forward's wrapper, when the function it wraps was traced (wrappers.py)
    leaves: list[str] = field(default_factory=list)  # submodules (paths from the region) kept as calls: they stop fx
    answers: list | None = None  # what the code asked of the example's sizes, in order (guarded; specialise.py)

    def to_dict(self) -> dict:
        return {"path": self.path, "route": self.route, "reason": self.reason, "concrete": self.concrete,
                "wrapped": self.wrapped, "tensors": self.tensors, "unwrapped": self.unwrapped, "leaves": self.leaves,
                "answers": self.answers}


@functools.lru_cache(maxsize=4096)
def signature(fn) -> inspect.Signature:
    """``inspect.signature(fn)``, computed once per function: a rewritten region binds every call it gets, and
    three signatures a call cost ~30 us (a tenth of a tiny BERT's fused step)."""
    return inspect.signature(fn)


def bind_call(module: nn.Module, call) -> inspect.BoundArguments | None:
    """``call`` (``(args, kwargs)``) bound to ``type(module).forward``'s signature, defaults applied; None when it
    does not fit."""
    args, kwargs = call
    try:
        bound = signature(type(module).forward).bind(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def _named_arguments(bound: inspect.BoundArguments | None):
    """(name, value) of each named parameter of a bound call, defaults included."""
    if bound is None:
        return
    for name, value in list(bound.arguments.items())[1:]:
        if bound.signature.parameters[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     inspect.Parameter.KEYWORD_ONLY):
            yield name, value


def concrete_args(module: nn.Module, call) -> dict:
    """Non-tensor arguments of the observed call (defaults included), keyed by parameter name: plain values and
    tuples of them (Swin's ``input_dimensions=(56, 56)``)."""
    return {name: value for name, value in _named_arguments(bind_call(module, call)) if _plain(value)}


def _plain(value) -> bool:
    return isinstance(value, _SCALARS) or (type(value) is tuple and all(isinstance(v, _SCALARS) for v in value))


def tensor_facts(module: nn.Module, call) -> dict:
    """``{name: {"ndim": int, "is_nested": bool}}`` for each tensor argument of the observed call;
    ``{name: {"empty": True}}`` for a ``**kwargs`` parameter the call left empty, and ``{name: {"constant":
    {key: value}}}`` for one it filled with plain values only (flags: a mixture-of-experts layer's
    ``output_router_logits=False``), which the traced code then reads as constants; one that holds tensors too
    (``position_ids=``) adds ``"tensors": [key, ...]``, which the traced code reads from the argument."""
    bound = bind_call(module, call)
    out = {name: {"ndim": value.dim(), "is_nested": bool(value.is_nested)}
           for name, value in _named_arguments(bound) if isinstance(value, torch.Tensor)}
    for p in bound.signature.parameters.values() if bound is not None else ():
        if p.kind != inspect.Parameter.VAR_KEYWORD:
            continue
        given = bound.arguments.get(p.name) or {}
        if not given:
            out[p.name] = {"empty": True}
        elif all(isinstance(v, _SCALARS) for v in given.values()):
            out[p.name] = {"constant": dict(given)}
        elif all(isinstance(v, (*_SCALARS, torch.Tensor)) for v in given.values()):
            out[p.name] = {"constant": {k: v for k, v in given.items() if not isinstance(v, torch.Tensor)},
                           "tensors": [k for k, v in given.items() if isinstance(v, torch.Tensor)]}
    return out


def type_name(cls: type) -> str:
    """``module:qualname`` of a class, as a fact keeps it (plans are JSON)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def object_facts(module: nn.Module, call) -> dict:
    """``{name: {"type": "module:qualname"}}`` for each argument of the observed call that is an object (not a
    tensor, a plain value or a container): a cache, a config. Traced code reads its class for real
    (``isinstance(cache, EncoderDecoderCache)`` took fx's proxy for another class and the wrong branch, silently),
    and the rewritten forward runs only for an argument of that class."""
    return {name: {"type": type_name(type(value))} for name, value in _named_arguments(bind_call(module, call))
            if not isinstance(value, (torch.Tensor, *_SCALARS, list, tuple, dict))}


def _same_constants(value, want: dict) -> bool:
    """``value`` is a dict with ``want``'s keys and, per key, a value of the same type that compares equal."""
    return isinstance(value, dict) and value.keys() == want.keys() and all(
        type(value[k]) is type(v) and value[k] == v for k, v in want.items())


def facts_hold(facts: dict, arguments: dict) -> bool:
    """Whether the bound ``arguments`` of a call have every fact a traced forward relied on."""
    for name, wanted in facts.items():
        value = arguments.get(name)
        if "tensors" in wanted:  # a **kwargs holding tensors: the same keys, constants and tensors
            given = value if isinstance(value, dict) else {}
            constants = {k: v for k, v in given.items() if k not in wanted["tensors"]}
            if not (_same_constants(constants, wanted["constant"]) and all(
                    isinstance(given.get(k), torch.Tensor) for k in wanted["tensors"])):
                return False
            continue
        taken = kwargs_values(wanted)
        if taken is not None:  # a **kwargs the traced code took as {} or as constants
            if not _same_constants(value or {}, taken):
                return False
            continue
        if "type" in wanted:  # an object argument: the class the traced code's branches were taken for
            if type_name(type(value)) != wanted["type"]:
                return False
            continue
        if not isinstance(value, torch.Tensor):
            return False
        got = {"ndim": value.dim(), "is_nested": bool(value.is_nested)}
        if any(got[k] != v for k, v in wanted.items()):
            return False
    return True


_PROBE_CHILD = "_opsnn_probe_child"


def _runs_its_children(module: nn.Module, gm: fx.GraphModule, concrete: dict, wrapped, facts, unwrap) -> bool:
    """True when ``module``'s forward would see a child registered after the trace (it calls, counts or
    indexes its children: ``nn.Sequential``, a loop over ``self.children()``), found by tracing it once more
    with an ``nn.Identity`` registered, then removed."""
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return True
    if not module._modules:
        return False
    module.add_module(_PROBE_CHILD, nn.Identity())
    try:
        probed, _ = trace_region(module, concrete, True, wrapped, facts, unwrap, gm.meta.get("leaves", ()),
                                 answers=gm.meta.get("answers"))
        return probed.code != gm.code
    except Exception:  # noqa: BLE001 - it traced without the extra child: the child is what stops it
        return True
    finally:
        del module._modules[_PROBE_CHILD]


def error_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message ('' for none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# an error raised here, in tracer.py or in specialise.py: no "at" (the message says where, if anywhere)
_OWN_FILES = {__file__, inspect.getsourcefile(trace_region), inspect.getsourcefile(check_guards)}


def _reason(exc: BaseException) -> str:
    """The error and the line of model code that stopped the tracer (the last frame outside torch)."""
    msg = error_line(exc)
    msg = msg.split(". ")[0]  # the error, not fx's advice after it ("... See the torch.fx docs on ...")
    user = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename
            and not f.filename.startswith("<") and f.filename not in _OWN_FILES]
    where = f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno}" if user else ""
    where = f"{where} `{(user[-1].line or '').strip()}`" if where and where not in msg else ""  # said once
    notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {msg[:360]}{where}{notes}"


def _note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` (Python 3.11+; the same attribute on 3.10), for ``_reason``."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), text]


def _first_trace(module: nn.Module, concrete: dict, call, leaf_ok=None) -> tuple[fx.GraphModule, list, dict, str]:
    """A plain trace, else one with the example call's tensor facts and its sizes answering the code's questions
    (specialise.py), else (a wrapped forward that passes the call through) one of the function the wrapper wraps;
    the last error stands, with a note on the wrapper. Returns (gm, wrapped helpers, facts, the wrapper's name or
    ''). Object arguments' classes are facts from the first trace on (``object_facts``)."""
    objects = object_facts(module, call)
    try:
        return (*trace_region(module, concrete, True, facts=objects or None, leaf_ok=leaf_ok), objects, "")
    except Exception:  # noqa: BLE001 - retried below
        facts = {**tensor_facts(module, call), **objects}
        wrapper = forward_wrapper(module)
        if facts == objects and not wrapper:
            raise
    bound = bind_call(module, call)
    example = dict(list(bound.arguments.items())[1:]) if bound is not None else None
    try:
        return (*trace_region(module, concrete, True, facts=facts or None, leaf_ok=leaf_ok, example=example),
                facts, "")
    except Exception:  # noqa: BLE001 - retried below when a wrapper is what fx cannot read
        if not wrapper:
            raise
    try:
        gm, wrapped = trace_region(module, concrete, True, facts=facts or None, unwrap=True, leaf_ok=leaf_ok,
                                   example=example)
    except Exception as exc:  # noqa: BLE001 - said where
        _note(exc, f"traced as the function `{wrapper}` wraps")
        raise
    return gm, wrapped, facts, wrapper


def _check_wrapper(module: nn.Module, call, wrapper: str, checked: dict) -> None:
    """Raise unless ``module``'s forward wrapper passes ``call`` through (``wrappers.passes_through``). A wrapper is
    replayed once per class, non-tensor arguments and flags (``gradient_checkpointing``, ``training``: what such a
    wrapper reads; ``checked`` keeps the verdicts): twelve BERT layers need one replay, not twelve."""
    flags = {k: v for k, v in vars(module).items() if isinstance(v, bool)}
    key = (type(module), wrapper, _plain_key(concrete_args(module, call)), _plain_key(flags))
    if key not in checked:
        state = instance_state(module)  # the forward runs twice below; what it caches in `self` is put back
        checked[key] = passes_through(module, call, lambda: restore_instance_state(state))
    why = checked[key]
    if why == "other values":
        raise RuntimeError(f"its forward is wrapped by `{wrapper}`, which returns other values than the function "
                           "it wraps on the example call (traced, that function would leave the wrapper out)")
    if why:
        err = RuntimeError(f"its forward is wrapped by `{wrapper}`; replayed, it raised")
        _note(err, f"the example call, replayed to check that the wrapped function returns the same: {why[:160]}")
        state = getattr(call, "state", None)
        if (state is None or not state.complete) and any(holds_tensors(v) for v in (*call[0], *call[1].values())):
            _note(err, "an argument holding tensors (a key/value cache) was updated in place after the call: with "
                       "Hugging Face models, train with `model.config.use_cache = False`")
        raise err


def _plain_key(values: dict) -> tuple:
    return tuple(sorted((k, type(v).__name__, v) for k, v in values.items() if _plain(v)))


def _returned_tensors(calls: dict, region: str, child: str) -> bool:
    """Whether every recorded call of ``child`` (a path from ``region``) returned one tensor."""
    recorded = calls.get(f"{region}.{child}" if region else child, [])
    return bool(recorded) and all(getattr(c, "bare", False) for c in recorded)


def _child_call_differs(gm: fx.GraphModule, path: str, children, calls: dict) -> str:
    """Why ``gm``'s code would call a child kept as a call (a region of its own) otherwise than the recorded forward
    did, or '': a plain argument the child's region is specialised for (``concrete_args``) that the traced code
    computes, or gives another value. Hugging Face's mask helpers build a mask while fx traces where eager passes
    None: the child's region would then run its original forward at every call, unfused."""
    by_name = dict(children)
    for node in gm.graph.nodes:
        child = by_name.get(node.target) if node.op == "call_module" else None
        recorded = calls.get(f"{path}.{node.target}" if path else node.target) if child is not None else None
        if not recorded:
            continue
        bound = bind_call(child, (node.args, node.kwargs))
        if bound is None:
            continue
        given = dict(_named_arguments(bound))
        for name, value in concrete_args(child, recorded[0]).items():
            got = given.get(name, value)
            if isinstance(got, fx.Node) or type(got) is not type(value) or got != value:
                shown = "a computed value" if isinstance(got, fx.Node) else repr(got)
                return (f"traced, its code calls `{node.target}` with {shown} for `{name}`, which the recorded call "
                        f"passed as {value!r}: that child's own region would run unfused, so this module runs its "
                        "own forward and its children are traced instead")
    return ""


def find_regions(model: nn.Module, calls: dict, hosts=None) -> list[Region]:
    """Largest traceable modules, top-down; an untraceable module is recorded with why, then its children.

    ``hosts(graph)``: whether a region's graph holds a chain that needs fx. A forward traced without its wrapper
    is replayed to check the wrapper (``_check_wrapper``: two forwards of the module) only where it does: BERT-base's
    encoder holds none (its layers are calls, for their hooks), and its replay was 5 of 16 s of the analysis."""
    regions: list[Region] = []
    seen: set[str] = set()
    checked: dict = {}

    def visit(path: str, module: nn.Module) -> None:
        if is_leaf_module(module) or path in seen:
            return
        seen.add(path)
        if path in calls:
            concrete = concrete_args(module, calls[path][0])
            try:
                gm, wrapped, facts, unwrapped = _first_trace(module, concrete, calls[path][0],
                                                             functools.partial(_returned_tensors, calls, path))
                container = _runs_its_children(module, gm, concrete, wrapped, facts, bool(unwrapped))
                graph = None if container else fx_graph(gm, path, module)
                if unwrapped and (container or hosts is None or hosts(graph)):
                    _check_wrapper(module, calls[path][0], unwrapped, checked)
            except Exception as exc:  # noqa: BLE001
                regions.append(Region(path, "untraceable", _reason(exc), concrete))
            else:
                leaves = list(gm.meta.get("leaves", ()))
                # kept as calls (hooks, or fx stops in them): regions of their own
                children = [(name, inner) for name, inner in module.named_modules()
                            if name and (has_hooks(inner) or name in leaves) and not is_leaf_module(inner)]
                clash = "" if container else _child_call_differs(gm, path, children, calls)
                if clash:
                    regions.append(Region(path, "untraceable", clash, concrete))
                elif not container:
                    regions.append(Region(path, "fx", "", concrete, [f.__name__ for f in wrapped], graph, facts,
                                          unwrapped, leaves, gm.meta.get("answers")))
                    for name, inner in children:
                        visit(f"{path}.{name}" if path else name, inner)
                    return
                else:
                    why = (f"`{type(module).__name__}` runs its children in turn: a fused op registered on it "
                           "would become one more step, so its children are rewritten instead")
                    regions.append(Region(path, "container", why, concrete))
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return regions
