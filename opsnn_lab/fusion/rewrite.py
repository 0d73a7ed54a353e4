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
import inspect
import operator
import re
import types
import warnings

import torch
from torch import fx, nn

from opsnn_lab._checks import check_type
from opsnn_lab._randomness import draw_state, draw_streams, draws_random, enter_module, exit_module, streams_made
from opsnn_lab.fusion._opaque import opaque_to_compile
from opsnn_lab.fusion.graph import Graph, Node, Ref, canonical_module
from opsnn_lab.fusion.patch import (
    CONSTANT,
    Patch,
    RepackAfterApply,
    Route,
    fused_ops,
    inline_after,
    install,
    revert,
    settings,
)
from opsnn_lab.fusion.patterns import Match, find_all, pattern_of
from opsnn_lab.fusion.patterns_blocks import norm_verdicts
from opsnn_lab.fusion.plan import Decision, FusionPlan
from opsnn_lab.fusion.probe import probe_modules
from opsnn_lab.fusion.regions import (
    bind_call,
    concrete_args,
    error_line,
    facts_hold,
    fx_graph,
    library_hooks,
    signature,
    tensor_facts,
    trace_region,
)
from opsnn_lab.fusion.runtime import buffers_kept, flatten_tensors, graph_free_memo, own_dtypes
from opsnn_lab.fusion.specialise import GUARDS, SpecialisationMiss, writes_in_place
from opsnn_lab.fusion.tracer import apply_function, kwargs_values

__all__ = ["apply", "FusedSlot", "FxForward", "revert", "REWRITE_FAILED"]

REWRITE_FAILED = "the fx rewrite of"
_MISSING = object()  # how a decision whose region failed its rewrite starts (the sweep looks)


class FusedSlot(nn.Module):
    """Calls a fused op whose parameters are registered elsewhere in the model (so: no state of its own)."""

    def __init__(self, op: nn.Module, pattern: str, modules: list[str]):
        super().__init__()
        object.__setattr__(self, "op", op)  # not a child: its Parameters already have their state_dict keys
        self.pattern, self.fused_modules = pattern, list(modules)

    @opaque_to_compile  # opaque to torch.compile, like the module-level patches (patch.py)
    def forward(self, *args):
        if self.op.training != self.training:  # the slot's flag is the one model.train()/eval() sets
            self.op.train(self.training)
        return self.op(*args)

    def _apply(self, fn, recurse=True):
        self.op._apply(fn)  # buffers the op holds itself follow .to()/.half(); shared ones are idempotent
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.pattern}: {', '.join(self.fused_modules)} -> {type(self.op).__name__}"


def _name_stream(op: nn.Module, m: Match) -> nn.Module:
    """Name a fused op's dropout stream after the dropout module it absorbs (``op.rng_name``), so that
    ``ol.consistency.make_reproducible`` seeds it as it seeds that module in the unfused model: the same
    masks, fused or not. An absorbed counter-based module lends the op its stream (``share_rng``), so a module
    also called outside the chain keeps drawing in call order. A chain without a dropout module (or with an
    inline ``F.dropout``) keeps none."""
    drop = next((n for n in m.nodes if n.op == "dropout" and n.kind == "module" and n.module), None)
    if drop is not None and hasattr(op, "set_rng"):
        op.rng_name = drop.module
        if hasattr(drop.obj, "next_draw"):  # a counter-based module, maybe called again elsewhere: one counter
            op.share_rng(drop.obj)
    elif m.params.get("rng_name") and hasattr(op, "set_rng"):  # an inline F.dropout: the stream it is drawn from
        op.rng_name = m.params["rng_name"]
    return op


def _rewrite(gm, g, m: Match, slot: str, moved: dict) -> None:
    """Replace ``m``'s chain by one call of ``slot``; ``moved`` maps replaced fx nodes to their replacement."""
    graph = gm.graph
    chain = [n.ref for n in m.nodes]
    inputs = tuple(moved.get(g[name].ref, g[name].ref) for name in m.inputs)
    anchor = chain[0] if m.pattern == "qkv" else chain[-1]
    # An output the code reads before the chain ends (FocalNet reads the residual sum's ``.shape`` before its
    # norm) needs the fused call before that read; the inputs come before the chain's first node.
    order = {node: i for i, node in enumerate(graph.nodes)}
    readers = [u for out in m.outputs for u in out.ref.users if u not in chain and u.op != "output"]
    first = min([anchor, *readers], key=order.__getitem__)
    if all(order[n] < order[first] for n in inputs if isinstance(n, fx.Node)):
        anchor = first
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


class FxForward(Patch):
    """A region's forward after an fx rewrite: the traced code in train or eval mode, the original otherwise.

    In eval mode without grad (``torch.no_grad``, ``inference_mode``) the original runs: no activation is saved
    there, so fusion gains nothing, and the original keeps its own inference path (``nn.TransformerEncoderLayer``'s
    fast path: the traced code was 1.22x its time). Its results are then eager's, bit for bit.

    Bound on the instance (``region.__dict__["forward"]``), never a class made at run time, so the model
    pickles. Arguments are bound to the original signature first and handed to the traced code parameter by
    parameter (fx keeps their order but renames a specialised one: ``height`` -> ``height_1``), so every
    keyword the original accepts (``output_hidden_states=``, ``return_dict=``) is accepted. A dict subclass
    the original returns (a Hugging Face ``ModelOutput``), which fx's code returns as a plain dict, is rebuilt.
    """

    warned = False  # defaults for a region pickled before these fields existed
    path = ""

    def __init__(self, host: nn.Module, variants: dict, concrete: dict, path: str = "", route: dict | None = None,
                 keys: dict | None = None):
        super().__init__(host)
        self.path = path  # the region's qualified name, for the warning a hook added later brings
        # how it was traced and what it fused, to trace it again for a call with other plain arguments
        # (``_alternate``); None for an alternate itself
        self.route, self.keys, self.alternates = route, keys, {}
        # a tuple argument the code was specialised for is a list in a plan from JSON
        self.variants = variants
        self.concrete = {k: tuple(v) if isinstance(v, list) else v for k, v in concrete.items()}
        self.output_types = {k: gm.meta.get("output_type") for k, gm in variants.items()}
        self.facts = {k: gm.meta.get("facts_read", {}) for k, gm in variants.items()}  # tensor ranks it relied on
        # the submodules whose forwards the traced code runs inline: if one gains hooks later (a user's, or Hugging
        # Face's output capture installed on first use), this region runs its original forward, so they fire
        self.inlined = {k: _inlined(host, gm) for k, gm in variants.items()}
        # the plain attributes of the region and of those submodules, which the code holds as constants (a dropout's
        # p, a drop path's rate) or a fused op took over: if one changes, this region runs its original forward
        self.recorded = {k: [host, *self._modules_now(k, self.inlined[k])] for k in variants}
        self.settings = {k: settings(self.recorded[k], _slot_ops(gm)) for k, gm in variants.items()}
        # traced without the forward's wrapper (fusion.wrappers): with gradient checkpointing on, the wrapper
        # checkpoints (Hugging Face's layers), so the original runs
        self.unwrapped = any(gm.meta.get("unwrapped") for gm in variants.values())
        # a guard comes after a draw (specialise.check_guards): the generators' state is kept at each call and put
        # back before the original forward runs on a miss, so it draws what eager draws
        self.restore_rng = {k: bool(gm.meta.get("restore_rng")) for k, gm in variants.items()}

    def ops(self) -> list[nn.Module]:
        return [op for gm in self.variants.values() for op in _slot_ops(gm)] + \
            [op for alt in self.__dict__.get("alternates", {}).values() if alt is not None for op in alt.ops()]

    MAX_ALTERNATES = 4  # plain arguments that take many values (a step counter) would trace without end

    def _alternate(self, args, kwargs) -> FxForward | None:
        """The region traced for this call's plain arguments, where they differ from those it was traced for
        (None if they cannot be, or nothing planned fuses there): made on the first such call, kept for the next.

        Hugging Face code hands a layer ``attention_mask=None`` where every token is real (the example one
        usually is) and a tensor where a batch is padded, and ``use_cache`` or ``output_attentions`` flip between
        calls: the code was traced for the example's values only, so every padded batch ran the original forward
        (BERT: 0.83 of eager's activation bytes against 0.65). Traced again for such a call, with the plan's
        chains and the same ops (``_region_slots``), the region stays fused; the new code checks hooks, settings and
        modes as the first does."""
        route, keys = self.__dict__.get("route"), self.__dict__.get("keys")
        if not route or keys is None:
            return None
        concrete = concrete_args(self.host, (args, kwargs))
        key = tuple(sorted(concrete.items()))
        alternates = self.__dict__.setdefault("alternates", {})
        if key not in alternates:
            if len(alternates) >= self.MAX_ALTERNATES:
                return None
            alternates[key] = self._trace_alternate(concrete, args, kwargs, len(alternates))
        return alternates[key]

    def _trace_alternate(self, concrete: dict, args, kwargs, n: int) -> FxForward | None:
        given = bind_call(self.host, (args, kwargs)).arguments
        differs = ", ".join(f"`{k}` {v!r} -> {concrete[k]!r}" if k in concrete else
                            f"`{k}` {v!r} -> a {type(given.get(k)).__name__}"
                            for k, v in self.concrete.items() if concrete.get(k, _MISSING) != v)
        route = {**self.route, "concrete": concrete, "tensors": tensor_facts(self.host, (args, kwargs)),
                 "answers": None}
        example = dict(given)
        try:
            alt, done = _traced_region(self.host, route, self.keys, _region_slots(self.host), f"alt{n}_", example)
        except Exception as exc:  # noqa: BLE001 - tracer errors have many types: this call's values stay unfused
            warnings.warn(f"opsnn_lab.fusion: the region `{self.path or '<model>'}` was fused for other arguments than "
                          f"this call's ({differs}), and its code cannot be traced for these "
                          f"({type(exc).__name__}: {error_line(exc)[:200]}); such calls run it unfused",
                          RuntimeWarning, stacklevel=4)
            return None
        if not done:
            return None
        alt.route = None  # no alternates of its own
        return alt

    def _streams(self) -> list:
        """The counter streams the region's code may draw from (``_randomness.draw_streams``): found again once
        a stream was made anywhere since (``make_reproducible`` swaps its dropouts in after fusion)."""
        made, streams = self.__dict__.get("_draw_streams", (-1, None))
        if made != streams_made():
            made, streams = streams_made(), draw_streams(self.host)
            self.__dict__["_draw_streams"] = (made, streams)
        return streams

    def __getstate__(self):
        return {k: v for k, v in super().__getstate__().items() if k != "_draw_streams"}  # found after a load

    def __setstate__(self, state):  # a model saved before these fields existed: no rebuild, no hook check
        self.__dict__.update({"output_types": {}, "inlined": {}, "facts": {}, "unwrapped": False,
                              "restore_rng": {}, "settings": {}, "recorded": {}, "route": None, "keys": None,
                              "alternates": {}, **state})

    def _other_values(self, args, kwargs) -> bool:
        """Whether this call's plain arguments differ from those the code was traced for."""
        bound = bind_call(self.host, (args, kwargs))
        return bound is not None and any(type(got := bound.arguments.get(k)) is not type(v) or got != v
                                         for k, v in self.concrete.items())

    def _bound(self, args, kwargs):
        bound = bind_call(self.host, (args, kwargs))
        if bound is None:
            return None
        for k, v in self.concrete.items():
            got = bound.arguments.get(k)
            if type(got) is not type(v) or got != v:
                return None  # a call the rewrite was not specialised for
        if not facts_hold(self.facts.get(self.host.training, {}), bound.arguments):
            return None  # a tensor of another rank than the traced code assumed
        return bound

    def _routes(self, gm) -> list[tuple[str, str, inspect._ParameterKind]]:
        """``(original parameter, traced parameter, its kind)`` per argument of the traced code, made once per
        variant (two signatures and a filter: ~10 us a call otherwise). By name: fx keeps a parameter's name or
        suffixes it (a specialised ``use_cache`` -> ``use_cache_1``, ``input`` -> ``input_1``); by position only
        where a name is neither. Positions alone went wrong where fx leaves out a parameter the original has (a
        keyword-only one: Bart's decoder layers), which fed each specialised value its default instead: a
        ``use_cache`` specialised False then failed fx's own check (``model.config.use_cache = False``)."""
        routes = self.__dict__.setdefault("_route_cache", {})
        key = self.host.training
        if key not in routes:
            traced = list(signature(type(gm).forward).parameters.items())[1:]
            names = list(signature(type(self.host).forward).parameters)[1:]
            by_name = [n if n in names else re.sub(r"_\d+$", "", n) for n, _ in traced]
            if not set(by_name) <= set(names):
                # a **kwargs the traced code took as {} or as constants: not an argument of the traced code
                facts = self.facts.get(key, {})
                by_name = [n for n in names if kwargs_values(facts.get(n, {})) is None]
                if len(by_name) != len(traced):
                    by_name = [name for name, _ in traced]
            routes[key] = [(source, name, p.kind) for source, (name, p) in zip(by_name, traced)]
        return routes[key]

    def __call__(self, *args, **kwargs):
        gm = self.variants.get(self.host.training)
        key = self.host.training
        # a hook on a module the code runs inline, a module replaced, a setting the code holds as a constant changed
        if gm is not None and self._stale(key, self.inlined.get(key, ()), self.recorded.get(key),
                                          self.settings.get(key, ()), f"the region `{self.path or '<model>'}`"):
            gm = None
        if not self.host.training and not torch.is_grad_enabled():
            gm = None  # inference: nothing is saved for a backward, and the original may take a fast path
        if self.unwrapped and getattr(self.host, "gradient_checkpointing", False):
            gm = None
        bound = None if gm is None else self._bound(args, kwargs)
        if bound is None:
            alt = self._alternate(args, kwargs) if gm is not None and self._other_values(args, kwargs) else None
            return alt(*args, **kwargs) if alt is not None else type(self.host).forward(self.host, *args, **kwargs)
        pos, kw = [], {}
        for source, name, kind in self._routes(gm):
            if source not in bound.arguments:
                continue
            value = bound.arguments[source]
            if kind == inspect.Parameter.VAR_POSITIONAL:
                pos.extend(value)
            elif kind == inspect.Parameter.VAR_KEYWORD:
                kw.update(value)
            elif kind == inspect.Parameter.POSITIONAL_ONLY:
                pos.append(value)
            else:
                kw[name] = value
        put_back = draw_state(self._streams(), flatten_tensors((args, kwargs))) \
            if self.restore_rng.get(self.host.training) else None
        try:
            out = type(gm).forward(self.host, *pos, **kw)
        except SpecialisationMiss:  # sizes the traced code branched on differ here; what ran before can run again
            if put_back is not None:  # and draw again what it drew
                put_back()
            return type(self.host).forward(self.host, *args, **kwargs)
        kind = self.output_types.get(self.host.training)
        if kind is not None and type(out) is dict:
            out = kind(**out) if dataclasses.is_dataclass(kind) else kind(out)
        return out


def _impure(node) -> bool:
    """fx's rule plus what it calls pure but a model relies on: a write into a tensor (``y.mul_(2)``, ``x[i] = v``,
    ``inplace=True``), any module call (a BatchNorm updates its statistics) and the guards of specialise.py."""
    return node.is_impure() or node.op == "call_module" or node.target in GUARDS or writes_in_place(node)


def _eliminate_dead_code(graph) -> None:
    """Drop what the rewrite left unused (weights, shapes the replaced steps read), never a write whose result
    the code ignores: fx's own rule dropped ``y.mul_(2)`` after a fused chain, and with it the model's scaling.
    A torch whose ``eliminate_dead_code`` takes no rule keeps every node (dead ones cost a little time, no bits)."""
    if "is_impure_node" in inspect.signature(graph.eliminate_dead_code).parameters:
        graph.eliminate_dead_code(is_impure_node=_impure)


def _slot_ops(gm) -> list[nn.Module]:
    """The fused ops ``gm``'s code calls."""
    slots = (gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module")
    return [slot.op for slot in slots if isinstance(slot, FusedSlot)]


def _inlined(host: nn.Module, gm) -> list[str]:
    """The paths (from ``host``) of its submodules that ``gm``'s code does not call, nor any module it calls
    holds."""
    called = {id(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"}
    out: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if id(child) not in called:
                out.append(prefix + name)
                walk(child, f"{prefix}{name}.")

    walk(host, "")
    return out


def _variant(m: Match) -> tuple:
    """What a match's op is built from beyond its modules: one op serves the calls of a module called twice (ALBERT's
    shared layer: the same settings, one stream), but two chains in one forward that share a key (DiffLlama's two
    attention cores in one module: the first's probabilities returned, each its own dropout stream) get one each.
    Sharing one gave the second the first's tuple output, where its code reads a tensor."""
    return len(m.outputs), tuple(sorted((k, v) for k, v in m.params.items()
                                        if v is None or isinstance(v, (bool, int, float, str))))


def _rewrite_region(model: nn.Module, route: dict, keys: dict, slots: dict) -> int:
    path = route["path"]
    region = model.get_submodule(path) if path else model
    patch, done = _traced_region(region, route, keys, slots)
    region.__dict__["forward"] = patch
    return done


def _traced_region(region: nn.Module, route: dict, keys: dict, slots: dict, tag: str = "",
                   example: dict | None = None) -> tuple[FxForward, int]:
    """The region's code traced for ``route``'s arguments, in train and eval mode, with the planned ``keys`` fused
    (ops from ``slots``, new ones added there and to the region), and how many chains it fused in training.
    ``tag`` names the constants of an alternate (``FxForward._alternate``), ``example`` answers its code's size
    questions."""
    path = route["path"]
    wrapped = [getattr(inspect.getmodule(type(region)), n) for n in route.get("wrapped", [])]
    variants, done = {}, 0
    for training in (True, False):
        try:
            gm, _ = trace_region(region, route["concrete"], training, wrapped, route.get("tensors") or None,
                                 bool(route.get("unwrapped")), route.get("leaves", ()), example=example,
                                 answers=route.get("answers"))
        except Exception:  # noqa: BLE001 - eval mode, which the analysis did not trace: the original runs there
            if training:
                raise
            break
        g, moved = fx_graph(gm, path, region), {}
        g.memo.update(norm_verdicts(keys))
        # Planned matches take their nodes in table order, as in the analysis: a node is rewritten once. A module
        # called twice gives one key two matches, and another planned match may hold one of them (ALBERT's
        # shared layer: add_layer_norm on the second call of its LayerNorm, layer_norm on the first).
        for m in find_all(g, claims=lambda m: m.key in keys):
            if not (m.ok and m.key in keys):
                continue
            for k, v in keys[m.key].items():  # values fx sees only as formulas (a shape-derived scale), and what
                if m.params.get(k, v) is None or k == "save_output":  # only the run-time record shows (in place)
                    m.params[k] = v
            site = (m.key, _variant(m))
            if site not in slots:
                op = _name_stream(pattern_of(m.pattern).build(m), m)
                name = next(n for i in range(len(slots), len(slots) + len(region._modules) + 1)
                            if (n := f"fused_{m.pattern}_{i}") not in region._modules)
                slots[site] = (name, FusedSlot(op, m.pattern, m.modules))
                slots[site][1].variant = site[1]  # an alternate's trace finds it again (_region_slots)
                slots[site][1].train(region.training)
                region.add_module(*slots[site])
            name, slot = slots[site]
            gm.add_submodule(name, slot)
            _rewrite(gm, g, m, name, moved)
            done += training
        _eliminate_dead_code(gm.graph)
        _keep_constants(gm, region, training, tag)
        _name_inlined_draws(gm.graph)
        gm.graph.lint()
        gm.recompile()
        variants[training] = gm
    return FxForward(region, variants, route["concrete"], path, route=route, keys=keys), done


def _region_slots(region: nn.Module) -> dict:
    """The fused ops the region's rewrite registered on it, as ``_traced_region`` finds them by site."""
    return {((s.pattern, tuple(s.fused_modules)), s.__dict__.get("variant")): (n, s)
            for n, s in region._modules.items() if isinstance(s, FusedSlot)}


def _name_inlined_draws(graph) -> None:
    """Key each random call the code makes inline for a submodule (a drop path, an inline ``F.dropout``) by that
    submodule, as its own call is keyed in the model left alone: ``make_reproducible`` names a call by the module
    running it, and the module the code runs inline has no call of its own (``_randomness.enter_module``). The
    fused ops draw under the name of the call they absorbed themselves (``ops.dropout.CounterRNG.next_draw``)."""
    for node in list(graph.nodes):
        stack = node.meta.get("nn_module_stack")
        if not stack or not (draws_random(node.op, node.target) or _runs_model_code(node)):
            continue
        # a traced value as an argument (the call's first input, else the code's first): fx records the call when
        # it traces the code again (to unpickle it), where a call of constants alone would just run
        after = node.all_input_nodes[:1] or [n for n in graph.nodes if n.op == "placeholder"][:1]
        with graph.inserting_before(node):
            # fx names a module's second call ``path@1``
            graph.call_function(enter_module, (next(reversed(stack)).partition("@")[0], *after))
        with graph.inserting_after(node):
            graph.call_function(exit_module, (node,))


def _runs_model_code(node) -> bool:
    """A call that runs the model's own Python as it is (an autowrapped helper, a custom autograd Function), which
    may draw (torchvision's ``stochastic_depth``, which fx cannot trace, is such a helper)."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is apply_function:
        return True
    home = (getattr(target, "__module__", None) or "").partition(".")[0]
    return isinstance(target, types.FunctionType) and home not in _LIBRARY_CODE


_LIBRARY_CODE = frozenset({"torch", "opsnn_lab", "operator", "builtins", "math"})  # they draw nothing of the model's


def _keep_constants(gm, region: nn.Module, training: bool, tag: str = "") -> None:
    """The tensors the tracer made constants (``torch.ones(8)`` in a forward, from no traced value): fx stows each
    on the traced root as ``_tensor_constant<i>``, gone from it once traced, while the code reads it from ``self``,
    which is the region when the code runs. Each is kept on the region under a name of its own (``CONSTANT``), as
    a plain attribute: like the tensor the original makes at each call, it does not move with ``.to()``."""
    renamed: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in renamed or _attr(region, node.target) is not None:
            if node.target in renamed:  # the same constant read again
                node.target = renamed[node.target]
            continue
        value = _attr(gm, node.target)
        if not isinstance(value, torch.Tensor) or "." in node.target:
            raise RuntimeError(f"the traced code reads `{node.target}`, which the region does not have")
        name = renamed[node.target] = f"{CONSTANT}{tag}{int(training)}_{node.target}"
        region.__dict__[name] = value
        setattr(gm, name, value)
        delattr(gm, node.target)  # one name per tensor: fx names a constant by its tensor when it re-traces the code
        node.target = name


def _attr(module: nn.Module, target: str):
    try:
        return operator.attrgetter(target)(module)
    except AttributeError:
        return None


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
        if inline:  # an inline dropout with p=0 (patch.inline_identity) between two steps
            scope = inline.rpartition(".")[0]
            nodes.append(Node(f"i{i}", "function", "dropout", [prev], (Ref(prev), 0.0), scope=scope))
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
            op = _name_stream(pattern_of(m.pattern).build(m), m)
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
    plan.saved_together = plan.activation_bytes - plan._analysis.cost.fused_total(
        [(d.key, tuple(d.nodes)) for d in plan.decisions if d.fused])
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
    from opsnn_lab.consistency.seed_pool import name_hosts

    name_hosts(fused)  # a fused op's absorbed stream, named in ``fused``, is found from a model that wraps it
    put_back()
    if any(hasattr(op, "repack") for op in fused_ops(fused)):  # packed weights: packed again after .to()/.half()
        fused.__dict__["_apply"] = RepackAfterApply(fused)
    return fused
