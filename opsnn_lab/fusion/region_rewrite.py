"""A region's code, traced with torch.fx and rewritten: each planned chain becomes one call of its fused op.

The op sits in a ``FusedSlot`` registered on the region (it shares the original Parameters and registers nothing, so
it adds no state_dict key); ``FxForward`` (region_forward.py) runs the code with the region's own signature.
"""

from __future__ import annotations

import inspect
import operator
import types

import torch
from torch import fx, nn

from opsnn_lab._opaque import opaque_to_compile
from opsnn_lab._randomness import draws_random, enter_module, exit_module
from opsnn_lab.fusion import owners
from opsnn_lab.fusion.patch_base import CONSTANT
from opsnn_lab.fusion.patterns import Match, find_all, pattern_of
from opsnn_lab.fusion.patterns_blocks import norm_verdicts
from opsnn_lab.fusion.regions import fx_graph, trace_region
from opsnn_lab.fusion.specialise import GUARDS, writes_in_place
from opsnn_lab.fusion.tracer import apply_function

__all__ = ["FusedSlot", "name_stream", "trace_variants", "region_slots", "slot_ops", "inlined_paths", "keep_constants"]


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
        return owners.call(self.op, *args)

    def _apply(self, fn, recurse=True):
        self.op._apply(fn)  # buffers the op holds itself follow .to()/.half(); shared ones are idempotent
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.pattern}: {', '.join(self.fused_modules)} -> {type(self.op).__name__}"


def name_stream(op: nn.Module, m: Match) -> nn.Module:
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
    if m.views:
        _rewrite_past_views(graph, chain, inputs, slot, moved)
        return
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


def _rewrite_past_views(graph, chain: list, inputs: tuple, slot: str, moved: dict) -> None:
    """A chain ``op -> views -> activation`` (``Match.views``): the fused call takes the op's place, the views read
    its output as they read the op's, and what read the activation reads the last view."""
    head, act = chain[0], chain[-1]
    with graph.inserting_before(head):
        new = graph.call_module(slot, inputs)
    head.replace_all_uses_with(new)
    act.replace_all_uses_with(act.args[0])
    moved[head], moved[act] = new, act.args[0]
    for node in (act, head):
        if not node.users:
            graph.erase_node(node)


def _impure(node, called_for_effect=frozenset()) -> bool:
    """fx's rule plus what it calls pure but a model relies on: a write into a tensor (``y.mul_(2)``, ``x[i] = v``,
    ``inplace=True``), any module call (a BatchNorm updates its statistics), the guards of specialise.py, and any
    call whose result the traced code itself ignored (``called_for_effect``: a wrapped function that writes into
    its argument and returns None, as torchvision's MViT adds its pooled shortcut)."""
    return node.is_impure() or node.op == "call_module" or node.target in GUARDS or writes_in_place(node) or \
        node in called_for_effect


def ignored_results(graph) -> frozenset:
    """The calls of the model's own functions (wrapped leaves: not torch's, not Python's operators) whose results the
    traced code does not read: made for what they do, not for what they return. A torch op or tensor method whose
    result is unread computes nothing the model keeps (one writing in place is kept by ``writes_in_place``), and
    keeping it would keep the chain nodes it reads; fx's own ``_assert_is_none`` (its check of a ``None`` default)
    is dropped as before."""
    return frozenset(n for n in graph.nodes if n.op == "call_function" and not n.users and _own_function(n.target))


def _own_function(fn) -> bool:
    package = (getattr(fn, "__module__", None) or "").split(".")[0]  # torchvision's functions are a model's own
    # opsnn_lab's own (the draw-naming calls ``_name_inlined_draws`` inserts after this pass) are this module's to place
    return package not in ("torch", "_operator", "operator", "math", "builtins", "opsnn_lab") and \
        getattr(fn, "__name__", "") != "_assert_is_none"


def _eliminate_dead_code(graph, called_for_effect=frozenset()) -> None:
    """Drop what the rewrite left unused (weights, shapes the replaced steps read), never a write whose result
    the code ignores: fx's own rule dropped ``y.mul_(2)`` after a fused chain, and with it the model's scaling;
    nor a call whose result the code ignored before the rewrite (``ignored_results``): it dropped MViT's
    ``_add_shortcut(x, q)``, so the fused model's training outputs were 0.94 off.
    A torch whose ``eliminate_dead_code`` takes no rule keeps every node (dead ones cost a little time, no bits)."""
    if "is_impure_node" in inspect.signature(graph.eliminate_dead_code).parameters:
        graph.eliminate_dead_code(is_impure_node=lambda n: _impure(n, called_for_effect))


def slot_ops(gm) -> list[nn.Module]:
    """The fused ops ``gm``'s code calls."""
    slots = (gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module")
    return [slot.op for slot in slots if isinstance(slot, FusedSlot)]


def inlined_paths(host: nn.Module, gm) -> list[str]:
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


def trace_variants(region: nn.Module, route: dict, keys: dict, slots: dict, tag: str = "",
                   example: dict | None = None) -> tuple[dict, int]:
    """The region's code traced for ``route``'s arguments, in train and eval mode (``{training: GraphModule}``),
    with the planned ``keys`` fused (ops from ``slots``, new ones added there and to the region), and how many
    chains it fused in training. ``tag`` names the constants of an alternate (``FxForward._alternate``),
    ``example`` answers its code's size questions."""
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
        g, moved, called_for_effect = fx_graph(gm, path, region), {}, ignored_results(gm.graph)
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
                op = name_stream(pattern_of(m.pattern).build(m), m)
                name = next(n for i in range(len(slots), len(slots) + len(region._modules) + 1)
                            if (n := f"fused_{m.pattern}_{i}") not in region._modules)
                slots[site] = (name, FusedSlot(op, m.pattern, m.modules))
                slots[site][1].variant = site[1]  # an alternate's trace finds it again (region_slots)
                slots[site][1].train(region.training)
                region.add_module(*slots[site])
            name, slot = slots[site]
            gm.add_submodule(name, slot)
            _rewrite(gm, g, m, name, moved)
            done += training
        _eliminate_dead_code(gm.graph, called_for_effect)
        keep_constants(gm, region, training, tag)
        _name_inlined_draws(gm.graph)
        gm.graph.lint()
        gm.recompile()
        variants[training] = gm
    return variants, done


def region_slots(region: nn.Module) -> dict:
    """The fused ops the region's rewrite registered on it, as ``trace_variants`` finds them by site."""
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


def keep_constants(gm, region: nn.Module, training: bool, tag: str = "") -> None:
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
