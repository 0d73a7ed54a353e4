"""Where torch.fx can rewrite: the whole model if it traces, else the largest submodules that do.

``symbolic_trace`` stops at data-dependent control flow, loops over tensor sizes, and isinstance checks
on its proxies. Two things widen what traces here: (1) a plain helper function that stops the tracer
(argument checks, for instance) is retried as an opaque call (``autowrap_functions``), so it still runs on
real tensors in the rewritten model; (2) non-tensor arguments seen on the example call (``mask=None``,
flags) are specialised, and the rewritten forward guards on them at run time (fallback: original code);
(3) when that still fails, the tensor arguments' rank and nestedness are those of the example call, so a
forward's checks on them (``x.dim() == 3``, ``(*x.shape[:-1], -1)``, ``x.is_nested``) read plain values,
and a ``**kwargs`` the call left empty is ``{}`` (Hugging Face forwards pass it on: ``f(..., **kwargs)``), one it
filled with plain values only is those values (``output_router_logits=False``);
each fact the traced code relied on is guarded at run time the same way. Sizes stay symbolic; (4) a forward
wrapped by a ``(self, *args, **kwargs)`` decorator is traced as the function it wraps when the wrapper passes
the example call through unchanged (``wrappers.py``: Hugging Face's gradient-checkpointing layers); (5) a
submodule whose own forward stops the tracer (a mixture-of-experts block routing tokens by their values) is kept
as one call in its parent's trace (``Region.leaves``), so the parent's code around it (the residual adds and norms
of a decoder layer) is still rewritten, and the submodule runs as it is.
When a module still fails, its children are tried; the reason is kept for the plan.

A module whose forward runs its children in turn (``nn.Sequential``, or any forward looping over
``self.children()``) is not a region even when it traces: the rewrite registers each fused op as a child of
its region (``rewrite.FusedSlot``), which there would become one more step. Its children are tried instead.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import sys
import traceback
import types
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from opsnn_lab._hooks import _HOOK_DICTS, has_hooks
from opsnn_lab.fusion.graph import Graph, Node, Ref, canonical_function, canonical_module, is_leaf_module
from opsnn_lab.fusion.wrappers import forward_wrapper, holds_tensors, passes_through, unwrapped_forward

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

    def to_dict(self) -> dict:
        return {"path": self.path, "route": self.route, "reason": self.reason, "concrete": self.concrete,
                "wrapped": self.wrapped, "tensors": self.tensors, "unwrapped": self.unwrapped, "leaves": self.leaves}


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
    """Non-tensor arguments of the observed call (defaults included), keyed by parameter name."""
    return {name: value for name, value in _named_arguments(bind_call(module, call)) if isinstance(value, _SCALARS)}


def tensor_facts(module: nn.Module, call) -> dict:
    """``{name: {"ndim": int, "is_nested": bool}}`` for each tensor argument of the observed call;
    ``{name: {"empty": True}}`` for a ``**kwargs`` parameter the call left empty, and ``{name: {"constant":
    {key: value}}}`` for one it filled with plain values only (flags: a mixture-of-experts layer's
    ``output_router_logits=False``), which the traced code then reads as constants."""
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
    return out


def _same_constants(value, want: dict) -> bool:
    """``value`` is a dict with ``want``'s keys and, per key, a value of the same type that compares equal."""
    return isinstance(value, dict) and value.keys() == want.keys() and all(
        type(value[k]) is type(v) and value[k] == v for k, v in want.items())


def facts_hold(facts: dict, arguments: dict) -> bool:
    """Whether the bound ``arguments`` of a call have every fact a traced forward relied on."""
    for name, wanted in facts.items():
        value = arguments.get(name)
        if wanted.get("empty"):  # a **kwargs the traced code took as {}
            if value:
                return False
            continue
        if "constant" in wanted:  # a **kwargs of plain values the traced code took as constants
            if not _same_constants(value or {}, wanted["constant"]):
                return False
            continue
        if not isinstance(value, torch.Tensor):
            return False
        got = {"ndim": value.dim(), "is_nested": bool(value.is_nested)}
        if any(got[k] != v for k, v in wanted.items()):
            return False
    return True


def _blocker(exc: BaseException, module: nn.Module):
    """The plain function called from ``forward`` that raised, if any (a candidate for autowrap)."""
    frames = traceback.extract_tb(exc.__traceback__)
    fwd_file = inspect.getsourcefile(type(module).forward)
    for outer, inner in zip(frames, frames[1:]):
        if outer.name == "forward" and outer.filename == fwd_file:
            fn = type(module).forward.__globals__.get(inner.name)
            if isinstance(fn, types.FunctionType):
                return fn
    return None


class _InputProxy(fx.Proxy):
    """A tensor argument of the traced forward whose rank and nestedness are the example's: ``dim()``, ``ndim``,
    ``is_nested`` are plain values and ``shape`` / ``size()`` a tuple of one size proxy per dimension (so it
    slices and unpacks). Each fact read is noted in ``tracer.facts_read`` for the run-time guard."""

    def __init__(self, node: fx.Node, tracer, name: str, facts: dict):
        super().__init__(node, tracer)
        self._name, self._facts = name, facts

    def _read(self, fact: str):
        self.tracer.facts_read.setdefault(self._name, {})[fact] = self._facts[fact]
        return self._facts[fact]

    def _sizes(self) -> tuple:
        size = super().__getattr__("size")
        return tuple(size(i) for i in range(self._read("ndim")))

    def __getattr__(self, k):
        if k in ("ndim", "is_nested"):
            return self._read(k)
        if k in ("dim", "ndimension"):
            ndim = self._read("ndim")
            return lambda: ndim
        if k == "shape":
            return self._sizes()
        if k == "size":
            size = super().__getattr__("size")
            return lambda *a, **kw: size(*a, **kw) if a or kw else self._sizes()
        return super().__getattr__(k)


class _Tracer(fx.Tracer):
    """Keeps opsnn_lab.ops modules (e.g. the counter-based Dropout) as calls, as the run-time trace does.

    ``output_type``: the class of the value the forward returned when it is a dict subclass (a Hugging Face
    ``ModelOutput``): fx's code returns a plain dict there, which the rewritten forward turns back into it.
    ``tensor_facts``: the example's facts per tensor argument (``tensor_facts``), given only on the retry.
    """

    output_type: type | None = None
    flat_output_type: type | None = None
    _depth = 0

    def __init__(self, autowrap_functions=(), tensor_facts=None, leaves=()):
        super().__init__(autowrap_functions=autowrap_functions)
        self.tensor_facts, self.facts_read = dict(tensor_facts or {}), {}
        self.empty_kwargs: list[fx.Node] = []  # their placeholders, dropped from the graph after the trace
        self.leaves, self.leaf_ids = tuple(leaves), set()
        self.failed_child: str | None = None  # the innermost submodule whose forward raised, by path

    def trace(self, root, concrete_args=None):
        self.leaf_ids = {id(root.get_submodule(p)) for p in self.leaves}
        return super().trace(root, concrete_args)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_child is None:  # the innermost call sees the error first
                self.failed_child = next((p for p, sub in self.root.named_modules() if sub is m), None)
            raise

    def proxy(self, node: fx.Node):
        name = str(node.target).lstrip("*")
        if node.op == "placeholder" and name in self.tensor_facts:
            facts = self.tensor_facts[name]
            if facts.get("empty") or "constant" in facts:  # **kwargs: the forward sees {} or its constants (guarded)
                self.facts_read[name] = dict(facts)
                self.empty_kwargs.append(node)
                return dict(facts.get("constant", {}))
            return _InputProxy(node, self, name, self.tensor_facts[name])
        return super().proxy(node)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A module already rewritten at module level (patch.py) stays a call, so its patch runs; so does one
        # with hooks, so they fire (Hugging Face records hidden states and attentions with forward hooks).
        # Built-in modules are leaves as in fx, except the composites the run-time trace looks into too
        # (graph.is_leaf_module: nn.TransformerEncoderLayer runs its Linears and norms as a user module would).
        patched = callable(m.__dict__.get("forward"))
        return patched or has_hooks(m) or is_leaf_module(m) or id(m) in self.leaf_ids

    def create_arg(self, a):
        if self._depth == 0:  # the last top-level value turned into graph arguments is the forward's output
            self.output_type = type(a) if isinstance(a, dict) and type(a) is not dict else None
            # fx's flattened output (see _drop_empty_kwargs) is a list holding the value: its class
            self.flat_output_type = next((type(v) for v in a if isinstance(v, dict) and type(v) is not dict),
                                         None) if type(a) is list and len(a) == 1 else None
        self._depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._depth -= 1


_RETRIES = 8  # traces of one region: each retry keeps one more helper or submodule opaque


@contextlib.contextmanager
def library_hooks(model: nn.Module):
    """The hooks a library adds on first use, installed while the analysis and the rewrite look at the model,
    then removed (they hold closures that do not pickle, and ``model`` must leave as it came): Hugging Face
    models record ``output_hidden_states`` / ``output_attentions`` with forward hooks on their layers, installed
    the first time a call asks for them. With them present, a region's fx code calls those layers instead of
    inlining them, so the outputs are recorded whenever a later call asks."""
    install = _hf_hook_installer()
    if install is None:
        yield
        return
    before = {m: ({k: set(getattr(m, k)) for k in _HOOK_DICTS}, m.__dict__.get(_HF_FLAG, _ABSENT))
              for m in model.modules()}
    try:
        for module in model.modules():
            if getattr(module, "_can_record_outputs", None):
                try:
                    install(module)
                except Exception:  # noqa: BLE001 - a model this installer does not know: its first call will
                    pass
        yield
    finally:
        for m, (kept, flag) in before.items():
            for k, keys in kept.items():
                hooks = getattr(m, k)
                for key in [key for key in hooks if key not in keys]:
                    del hooks[key]
            if flag is _ABSENT:
                m.__dict__.pop(_HF_FLAG, None)
            else:
                m.__dict__[_HF_FLAG] = flag


_HF_FLAG = "_output_capturing_hooks_installed"  # set on each model the installer hooked
_ABSENT = object()


def _hf_hook_installer():
    """transformers' installer of its output-capturing hooks, where transformers is loaded and has one."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # another transformers version: nothing to install here
        return None
    return maybe_install_capturing_hooks


def trace_region(module: nn.Module, concrete: dict, training: bool, wrapped=(),
                 facts: dict | None = None, unwrap: bool = False, leaves=(),
                 leaf_ok=None) -> tuple[fx.GraphModule, list]:
    """fx-trace ``module`` in train or eval mode (flags restored), autowrapping helpers that stop the tracer.

    ``leaves``: submodules (paths from ``module``) kept as one call each. ``leaf_ok(path)``: whether a submodule
    whose own forward stops the tracer may be kept so too (the caller knows it returned one tensor: the traced
    code gets a proxy for its result, and a tuple holding None would take the wrong branch at an ``is None``);
    the final list is ``gm.meta["leaves"]``.

    ``facts`` (from ``tensor_facts``) gives the tensor arguments the example's rank; the facts the code read
    are in ``gm.meta["facts_read"]``, for the caller to guard on. ``unwrap``: trace the function the forward's
    wrapper wraps (``gm.meta["unwrapped"]``; see wrappers.py).

    The modules' own attributes are restored afterwards too: a forward that caches in ``self`` (LeViT's
    eval-mode attention biases) would otherwise keep fx proxies there, which do not pickle."""
    flags = {m: m.training for m in module.modules()}
    state = _instance_state(module)
    module.train(training)
    wrapped, leaves = list(wrapped), list(leaves)
    try:
        for _ in range(_RETRIES):
            tracer = _Tracer(tuple(wrapped), facts, leaves)
            try:
                with unwrapped_forward(module) if unwrap else contextlib.nullcontext():
                    graph = tracer.trace(module, concrete_args=dict(concrete) or None)
                flattened_output = _drop_empty_kwargs(graph, tracer)
                for node in graph.nodes:  # the call of a submodule named ``self`` (ConvBERT's attention.self):
                    if node.name == "self":  # fx names its result ``self``, which shadows the module in the code
                        node._rename("self_module")
                gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
                gm.meta["output_type"] = flattened_output or tracer.output_type
                gm.meta["facts_read"] = tracer.facts_read
                gm.meta["unwrapped"] = unwrap
                gm.meta["leaves"] = leaves
                return gm, wrapped
            except Exception as exc:  # noqa: BLE001 - any tracer failure sends us one level down
                fn = _blocker(exc, module)
                if fn is not None and fn not in wrapped:
                    wrapped.append(fn)
                elif tracer.failed_child and tracer.failed_child not in leaves and leaf_ok and \
                        leaf_ok(tracer.failed_child):
                    leaves.append(tracer.failed_child)
                else:
                    raise
        raise RuntimeError("too many helper functions and submodules stop the tracer")
    finally:
        for m, flag in flags.items():
            m.training = flag
        _restore_instance_state(state)


def _drop_empty_kwargs(graph: fx.Graph, tracer: _Tracer) -> type | None:
    """Remove the ``**kwargs`` placeholders the forward saw as ``{}``. That ``{}`` was the one container among
    the forward's arguments, for which fx generated code that flattens the arguments and the output against
    specs kept on the GraphModule (``_PyTreeCodeGen``; the rewritten forward runs with the region as ``self``,
    which has none): the output is given its structure back and the code is plain fx code again. Returns the
    output's class when it is a dict subclass (``_Tracer.output_type``: fx saw only the flattened values)."""
    if not tracer.empty_kwargs:
        return None
    for node in tracer.empty_kwargs:
        graph.erase_node(node)
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None:
        return None
    kind = None
    if info.out_spec is not None:
        import torch.utils._pytree as pytree

        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        output.args = (pytree.tree_unflatten(list(output.args[0]), info.out_spec),)
        kind = info.out_spec.type if isinstance(info.out_spec.type, type) and \
            issubclass(info.out_spec.type, dict) and info.out_spec.type is not dict else None
        if info.out_spec.is_leaf():  # a class pytree does not know (a dict subclass): one leaf, the value
            kind = tracer.flat_output_type
    graph._codegen = fx.graph.CodeGen()
    return kind


# nn.Module's own bookkeeping, restored by other means (flags) or never touched by a forward
_MODULE_KEYS = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
                          "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_state_dict_pre_hooks",
                          "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                          "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook"})


def _instance_state(module: nn.Module) -> list:
    """Each module's plain attributes, with a shallow copy of each dict, list or set (a cache filled in place)."""
    out = []
    for m in module.modules():
        attrs = {k: (v, copy.copy(v) if type(v) in (dict, list, set) else None)
                 for k, v in m.__dict__.items() if k not in _MODULE_KEYS}
        out.append((m, attrs))
    return out


def _restore_instance_state(state: list) -> None:
    for m, attrs in state:
        for k in [k for k in m.__dict__ if k not in _MODULE_KEYS and k not in attrs]:
            del m.__dict__[k]
        for k, (value, contents) in attrs.items():
            m.__dict__[k] = value
            if contents is None:
                continue
            value.clear()  # refilled as it was (no == on contents: they may hold tensors)
            if isinstance(value, list):
                value.extend(contents)
            else:
                value.update(contents)


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
        probed, _ = trace_region(module, concrete, True, wrapped, facts, unwrap, gm.meta.get("leaves", ()))
        return probed.code != gm.code
    except Exception:  # noqa: BLE001 - it traced without the extra child: the child is what stops it
        return True
    finally:
        del module._modules[_PROBE_CHILD]


def error_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message ('' for none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _reason(exc: BaseException) -> str:
    """The error and the line of model code that stopped the tracer (the last frame outside torch)."""
    msg = error_line(exc)
    msg = msg.split(". ")[0]  # the error, not fx's advice after it ("... See the torch.fx docs on ...")
    user = [f for f in traceback.extract_tb(exc.__traceback__)
            if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.startswith("<")]
    where = f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno} `{(user[-1].line or '').strip()}`" \
        if user and user[-1].filename != __file__ else ""
    notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {msg[:160]}{where}{notes}"


def _note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` (Python 3.11+; the same attribute on 3.10), for ``_reason``."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), text]


def _first_trace(module: nn.Module, concrete: dict, call, leaf_ok=None) -> tuple[fx.GraphModule, list, dict, str]:
    """A plain trace, else one with the example call's tensor facts, else (a wrapped forward that passes the call
    through) one of the function the wrapper wraps; the last error stands, with a note on the wrapper. Returns
    (gm, wrapped helpers, facts, the wrapper's name or '')."""
    try:
        return (*trace_region(module, concrete, True, leaf_ok=leaf_ok), {}, "")
    except Exception:  # noqa: BLE001 - retried below
        facts = tensor_facts(module, call)
        wrapper = forward_wrapper(module)
        if not facts and not wrapper:
            raise
    try:
        return (*trace_region(module, concrete, True, facts=facts or None, leaf_ok=leaf_ok), facts, "")
    except Exception:  # noqa: BLE001 - retried below when a wrapper is what fx cannot read
        if not wrapper:
            raise
    try:
        gm, wrapped = trace_region(module, concrete, True, facts=facts or None, unwrap=True, leaf_ok=leaf_ok)
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
        state = _instance_state(module)  # the forward runs twice below; what it caches in `self` is put back
        checked[key] = passes_through(module, call, lambda: _restore_instance_state(state))
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
    return tuple(sorted((k, type(v).__name__, v) for k, v in values.items() if isinstance(v, _SCALARS)))


def _returned_tensors(calls: dict, region: str, child: str) -> bool:
    """Whether every recorded call of ``child`` (a path from ``region``) returned one tensor."""
    recorded = calls.get(f"{region}.{child}" if region else child, [])
    return bool(recorded) and all(getattr(c, "bare", False) for c in recorded)


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
                if not container:
                    leaves = list(gm.meta.get("leaves", ()))
                    regions.append(Region(path, "fx", "", concrete, [f.__name__ for f in wrapped], graph, facts,
                                          unwrapped, leaves))
                    for name, inner in module.named_modules():  # kept as calls (hooks, or fx stops in them): regions
                        if name and (has_hooks(inner) or name in leaves) and not is_leaf_module(inner):
                            visit(f"{path}.{name}" if path else name, inner)
                    return
                regions.append(Region(path, "container", f"`{type(module).__name__}` runs its children in turn: a "
                                      "fused op registered on it would become one more step, so its children are "
                                      "rewritten instead", concrete))
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return regions


# --------------------------------------------------------------------------- fx graph -> dataflow graph
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "T", "mT"}
_PY_MODULES = ("_operator", "operator", "builtins", "math")  # arithmetic on sizes stays arithmetic on sizes
_META_METHODS = {"size", "dim", "numel", "type", "stride", "is_contiguous", "get_device"}


def _is_meta(n: fx.Node, meta: set) -> bool:
    if n.op == "call_function" and n.target is getattr:
        return n.args[1] in _META_ATTRS - {"T", "mT"}
    if n.op == "call_method" and n.target in _META_METHODS:
        return True
    if n.op == "call_function" and getattr(n.target, "__module__", None) in _PY_MODULES:
        deps = n.all_input_nodes
        return bool(deps) and all(a.name in meta for a in deps)
    if n.op == "call_function" and getattr(n.target, "__name__", "") == "_assert_is_none":
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

