"""Guarded specialisation of a traced forward on its tensors' metadata (tracer.py, step 6).

fx stops where a forward branches on a size or iterates over a shape: Hugging Face's SDPA attention decides
``is_causal = q_length > 1 and ...`` from ``query.shape[2]``, GPT-2 builds ``(*key.shape[:-1], -1, head_dim)``.
When the example call is known, the tracer answers such a question from the example instead of stopping:

- only questions on metadata (``shape``, ``size()``, ``dim()``, ``dtype``, ``device``, and arithmetic on them),
  the number of pieces a split makes and a dtype handed to ``torch.finfo`` / ``torch.iinfo``; a branch on
  tensor values (``if mask.any()``) still stops the tracer;
- the answer is computed by running the few steps that lead to it on the example's tensors (no gradient; a
  draw with its sources put back afterwards); a step with state there (a BatchNorm, an in-place write, a module
  with hooks) stops it;
- each answer is a guard node in the traced code (``expect``), checked on the real tensors at each call; a call
  it does not hold for raises ``SpecialisationMiss`` and runs the original forward instead
  (``rewrite.FxForward``), so every step before a guard must be one that can run twice (``check_guards``), or
  one that only draws (a dropout, ``torch.rand``, a fused op's counter stream): the region then keeps where each
  source of draws stands at each call and puts it back before the original runs, which draws what eager draws;
- the answers, in the order asked, with the line that asked each, are kept with the region (JSON), so the
  rewrite traces the same code again without the example (``answers=``).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch import nn

from opsnn_lab._hooks import has_hooks
from opsnn_lab._randomness import draw_state, draw_streams
from opsnn_lab.fusion.graph import canonical_module
from opsnn_lab.fusion.ranks import rank_inputs, structure_inputs
from opsnn_lab.fusion.runtime import flatten_tensors

__all__ = ["SpecialisationMiss", "GuardAfterState", "expect", "expect_len", "expect_dtype", "GUARDS",
           "metadata_only", "answerable", "Answers", "check_guards", "only_draws", "INPLACE_OPERATORS",
           "writes_in_place", "PY_MODULES"]


class GuardAfterState(fx.proxy.TraceError):
    """``check_guards``: a guard comes after a step that cannot run twice; ``module``: the path (from the traced
    root) of the submodule whose code asked, '' for the root's own code."""

    def __init__(self, msg: str, module: str):
        super().__init__(msg)
        self.module = module


class SpecialisationMiss(Exception):
    """A call whose tensors' metadata differ from the example's where the traced code branched on them."""


def expect(value, answer: bool) -> None:
    """Guard: ``bool(value)`` is what the traced code assumed. Traced again (fx re-traces a GraphModule's code when
    it is unpickled), it is one call again."""
    if isinstance(value, fx.Proxy):
        return value.tracer.create_proxy("call_function", expect, (value, answer), {})
    if bool(value) is not answer:
        raise SpecialisationMiss(f"a condition on sizes was {not answer} here, {answer} when traced")


def expect_len(value, answer: int) -> None:
    """Guard: ``len(value)`` (a slice of a shape) is what the traced code assumed (traced again: one call)."""
    if isinstance(value, fx.Proxy):
        return value.tracer.create_proxy("call_function", expect_len, (value, answer), {})
    if len(value) != answer:
        raise SpecialisationMiss(f"a shape had {len(value)} entries here, {answer} when traced")


def expect_dtype(value, answer: str) -> None:
    """Guard: a dtype the traced code read (``torch.finfo(q.dtype)``) is ``answer`` (``"float32"``)."""
    if isinstance(value, fx.Proxy):
        return value.tracer.create_proxy("call_function", expect_dtype, (value, answer), {})
    if value is not getattr(torch, answer):
        raise SpecialisationMiss(f"a dtype was {value} here, torch.{answer} when traced")


GUARDS = (expect, expect_len, expect_dtype)
for _guard in GUARDS:  # kept by fx's dead-code elimination, as its own asserts are (region_rewrite._impure says so too)
    getattr(fx.node, "has_side_effect", lambda fn: fn)(_guard)

_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "is_nested", "layout", "is_sparse", "is_quantized",
               "requires_grad"}
_META_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "get_device",
                 "is_floating_point", "is_complex", "element_size"}
PY_MODULES = ("_operator", "operator", "builtins", "math")  # arithmetic on sizes stays arithmetic on sizes


def metadata_only(node: fx.Node) -> bool:
    """Whether ``node``'s value is a function of tensors' metadata only (sizes, rank, dtype, device)."""
    if node.op == "call_method":
        return node.target in _META_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        source = node.args[0]
        return node.args[1] in _META_ATTRS or (isinstance(source, fx.Node) and metadata_only(source))
    if getattr(node.target, "__module__", None) in PY_MODULES:
        deps = node.all_input_nodes
        return bool(deps) and all(metadata_only(d) for d in deps)
    return False


_SPLITS = {"chunk", "split", "split_with_sizes", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit"}


def answerable(node: fx.Node, kind: str) -> bool:
    """Whether the tracer may answer ``bool`` / ``len`` of ``node`` from the example: metadata, and the number of
    pieces a split makes (``for part in x.chunk(2)``: sizes decide it, not values)."""
    if metadata_only(node):
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return kind == "len" and node.op in ("call_method", "call_function") and name in _SPLITS


_RANDOM = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu",
           "bernoulli", "multinomial", "normal", "poisson", "rand", "randn", "randint", "randperm", "rand_like",
           "randn_like", "randint_like", "native_dropout"}
INPLACE_OPERATORS = frozenset({operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                               operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                               operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def writes_in_place(node: fx.Node) -> bool:
    """A method or function that writes into a tensor: ``y.mul_(2)``, ``x[i] = v``, ``inplace=True``."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.target in INPLACE_OPERATORS or node.kwargs.get("inplace") is True or (
        isinstance(name, str) and name.endswith("_") and not name.endswith("__"))


_DRAWS = "draws random numbers"  # the reason ``_why_not_twice`` gives last for a module, and ``only_draws`` reads


def _why_not_twice(node: fx.Node, root: nn.Module) -> str:
    """'' when running ``node`` twice changes nothing, else what it would change."""
    if node.op in ("placeholder", "get_attr", "output") or node.target in GUARDS:
        return ""
    if node.op == "call_module":
        m = root.get_submodule(node.target)
        if any(has_hooks(s) for s in m.modules()):
            return f"`{node.target}` has hooks"
        if any(getattr(s, "inplace", False) is True for s in m.modules()):
            return f"`{node.target}` writes in place"
        if next(m.buffers(), None) is not None:
            return f"`{node.target}` has buffers it may update"
        if any(isinstance(s, nn.modules.dropout._DropoutNd) or hasattr(s, "next_draw") for s in m.modules()):
            return f"`{node.target}` {_DRAWS}"
        return ""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if writes_in_place(node):
        return f"`{node.name}` writes in place"
    if name in _RANDOM:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)
        if not (name.endswith("dropout") and p == 0):
            return f"`{node.name}` {_DRAWS}"
    # what else may run twice: tensor methods and torch's and Python's functions; an object's method (a cache's
    # ``update``) or a helper kept opaque may change state
    if node.op == "call_method" and not hasattr(torch.Tensor, name):
        return f"`{node.name}` calls `{name}` on an object" + (_CACHE_HINT if _is_cache(node.args[0]) else "")
    module = getattr(node.target, "__module__", None) or ""
    if name == "apply_function":  # tracer.apply_function: a custom autograd Function, which may keep state
        return f"`{node.name}` runs the custom autograd Function `{node.args[0]}`"
    if node.op == "call_function" and not (module.split(".")[0] in ("torch", *PY_MODULES) or node.target is getattr):
        return f"`{node.name}` calls `{name}`"
    return ""


_CACHE_HINT = ", a key/value cache (a Hugging Face model trains without one: `model.config.use_cache = False`)"


def _is_cache(receiver) -> bool:
    """Whether an object whose method a forward calls is a key/value cache, by its name or the attribute path
    that reaches it (``past_key_values``, ``layer_past``, ``cache.self_attention_cache``)."""
    while isinstance(receiver, fx.Node):
        if "cache" in receiver.name.lower() or "past" in receiver.name.lower():
            return True
        if receiver.op == "call_function" and receiver.target is getattr:
            if "cache" in str(receiver.args[1]).lower():
                return True
            receiver = receiver.args[0]
        else:
            return False
    return False


_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})


def _plain_dropout(node: fx.Node, root: nn.Module) -> bool:
    """A dropout whose output has its input's shape and nothing else happens: no hooks, not in place."""
    if node.op == "call_module":
        m = root.get_submodule(node.target)
        return (isinstance(m, nn.modules.dropout._DropoutNd) or canonical_module(m) == "dropout") \
            and not getattr(m, "inplace", False) and not has_hooks(m) and not next(m.children(), None)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_function", "call_method") and name in _DROPOUTS and not writes_in_place(node)


def check_guards(graph: fx.Graph, root: nn.Module, facts: dict | None = None,
                 facts_read: dict | None = None) -> bool:
    """Raise ``GuardAfterState`` unless every step before each guard can run twice or only draws (``only_draws``):
    a call that misses a guard runs the original forward after the steps before it ran (``SpecialisationMiss``).
    True where a draw comes before a guard: the caller puts every source of draws back before it runs the
    original (``rewrite.FxForward``, ``_randomness.draw_state``). A guard on the number of sizes, or on a rank,
    whose answer the tensor arguments' ranks alone decide (``ranks.structure_inputs``, ``ranks.rank_inputs``;
    ``facts``: the example's, by argument) is dropped instead, those ranks noted in ``facts_read`` for the check
    made before the call runs."""
    for guard in [n for n in graph.nodes if n.op == "call_function" and n.target in (expect_len, expect)]:
        decided_by = structure_inputs if guard.target is expect_len else rank_inputs
        names = decided_by(guard.args[0], facts or {}, root) if facts_read is not None else None
        if names is not None and _after_state(guard, root):
            for name in names:
                facts_read.setdefault(name, {})["ndim"] = facts[name]["ndim"]
            graph.erase_node(guard)
    nodes = list(graph.nodes)
    guards = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target in GUARDS]
    draws = False
    for node in nodes[:guards[-1] if guards else 0]:
        why = _why_not_twice(node, root)
        if why and only_draws(node, root):
            draws = True
        elif why:
            first = next(nodes[i] for i in guards if i > nodes.index(node))
            where = f" at {first.meta['where']}" if first.meta.get("where") else ""
            stack = list((first.meta.get("nn_module_stack") or {}).values())
            raise GuardAfterState(f"control flow on sizes{where} follows a step that cannot run twice ({why})",
                                  stack[-1][0] if stack else "")
    return draws


def _after_state(guard: fx.Node, root: nn.Module) -> bool:
    node = guard.prev
    while node.op != "root":
        if _why_not_twice(node, root):
            return True
        node = node.prev
    return False


_REAL_CODE = [0]  # > 0 while an answer runs the model's code for real on the example (``Answers._value``)


@contextlib.contextmanager
def _real_code():
    _REAL_CODE[0] += 1
    try:
        yield
    finally:
        _REAL_CODE[0] -= 1


def runs_real_code() -> bool:
    """Whether the code running now is a step run on the example to answer a question, not code being traced: what
    it writes in a module (a counter stream's step) is its own, put back with its draws."""
    return _REAL_CODE[0] > 0


def _unpatched():
    """fx's own context that lifts its patches (``Module.__call__``, wrapped functions) while a trace runs."""
    try:
        from torch.fx._symbolic_trace import _maybe_revert_all_patches
    except ImportError:  # a torch without it: the steps run as fx traces them, and a proxy makes the answer fail
        return contextlib.nullcontext()
    return _maybe_revert_all_patches()


def only_draws(node: fx.Node, root: nn.Module) -> bool:
    """A step whose only effect is a draw: a random function or tensor method of torch (no ``generator=``, not in
    place), or a module whose one reason it cannot run twice is that it draws (a dropout, a counter stream, a
    module fusion patched with an op that draws). ``_randomness.draw_state`` puts every such source back."""
    if node.op == "call_module":
        return _why_not_twice(node, root).endswith(_DRAWS)  # its only reason: hooks, writes, buffers come first
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_function", "call_method") and name in _RANDOM and not writes_in_place(node) \
        and "generator" not in node.kwargs


@contextlib.contextmanager
def _drawing_aside(node: fx.Node, root: nn.Module, args):
    """Run a step that draws with every source of its draws put back afterwards (``_randomness.draw_state``):
    torch's generators, and the counter streams of a module the step calls."""
    streams = draw_streams(root.get_submodule(node.target)) if node.op == "call_module" else ()
    put_back = draw_state(streams, flatten_tensors(args))
    try:
        yield
    finally:
        put_back()


class Answers:
    """The answers a trace gave to questions on metadata, in order: computed from ``example`` (the call's
    arguments by parameter name) or replayed from ``given`` (a region's recorded answers)."""

    def __init__(self, root: nn.Module, example: dict | None = None, given: list | None = None):
        self.root, self.example = root, example
        self.given = None if given is None else [list(a) for a in given]
        self.asked: list = []
        self._cursor = 0
        self._values: dict = {}  # (node, structural) -> its value on the example
        self._structural = False  # answering a ``len`` or a rank: dropouts count as their input (``_plain_dropout``)
        self._facts: dict | None = None  # the example's tensor ranks, for ``_ranks_decide``

    @property
    def active(self) -> bool:
        return self.example is not None or self.given is not None

    def answer(self, node: fx.Node, kind: str, where: str = ""):
        """``bool``, ``len`` or ``dtype`` (its name: JSON) of ``node``'s value on the example, or the recorded answer
        to the same question (kind and line of model code, ``where``). Recorded answers are ``[kind, where,
        answer]`` in the order asked; a trace of the rewrite may skip some (a module patched since runs as one
        call, and its code asks nothing), never ask others."""
        if self.given is not None:
            at = next((i for i in range(self._cursor, len(self.given)) if self.given[i][:2] == [kind, where]), None)
            if at is None:
                raise fx.proxy.TraceError(f"the code asks a question on sizes the analysis did not ({kind} at "
                                          f"{where or 'an unknown line'})")
            self._cursor = at + 1
            got = self.given[at][2]
        else:
            # the number of sizes, or a rank, is the same with a dropout read as its input
            self._structural = kind == "len" or (kind == "bool" and self._ranks_decide(node))
            try:
                value = self._value(node)
            except fx.proxy.TraceError as exc:
                raise fx.proxy.TraceError(f"{exc}{' at ' + where if where else ''}") from None
            got = bool(value) if kind == "bool" else len(value) if kind == "len" else str(value).removeprefix("torch.")
        self.asked.append([kind, where, got])
        return got

    def _ranks_decide(self, node: fx.Node) -> bool:
        if self._facts is None:  # the example's tensor facts, as regions.tensor_facts records them
            self._facts = {k: {"ndim": v.ndim, "is_nested": v.is_nested} for k, v in (self.example or {}).items()
                           if isinstance(v, torch.Tensor)}
        return rank_inputs(node, self._facts, self.root) is not None

    def _value(self, node: fx.Node):
        key = (node, self._structural)
        if key in self._values:
            return self._values[key]
        why = _why_not_twice(node, self.root)
        if why and self._structural and _plain_dropout(node, self.root):
            # the number of sizes asked for (``len``) and a rank never depend on values: a dropout is its input
            # there, and draws nothing (whether the answer may stand without a guard is check_guards' question)
            value = self._value(node.args[0] if node.args else node.kwargs["input"])
        elif why and not only_draws(node, self.root):
            raise fx.proxy.TraceError(f"control flow on a size that comes from a step that cannot run twice ({why})")
        else:
            # a draw (a label dropout's ``torch.rand(n) < p``) runs with its sources put back afterwards: its sizes
            # are the ones a question needs, and the model's own draws stay as they were
            args = fx.node.map_arg((node.args, node.kwargs), self._value)
            with torch.no_grad(), _unpatched(), _real_code(), _drawing_aside(node, self.root, args) if why else \
                    contextlib.nullcontext():
                value = self._run(node, *args)
        self._values[key] = value
        return value

    def _run(self, node: fx.Node, args, kwargs):
        if node.op == "placeholder":
            name = str(node.target).lstrip("*")
            if name not in self.example:
                raise fx.proxy.TraceError(f"no example value for argument `{name}`")
            return self.example[name]
        if node.op == "get_attr":
            return operator.attrgetter(node.target)(self.root)
        if node.op == "call_module":
            return self.root.get_submodule(node.target)(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)
