"""Run-time dataflow trace: which tensor every call consumed and produced, in any model that runs.

One forward under a ``TorchFunctionMode`` (functional calls and tensor methods) plus global module hooks
(built-in ``torch.nn`` modules recorded as one node; user modules looked into, as fx does). No tracer
has to accept the code: data-dependent control flow, item assignment, ``**kwargs`` forwards and dataclass
outputs all just run. A ``saved_tensors_hooks`` pair attributes every tensor saved for backward to the
node that saved it; the cost model reads that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from opsnn_lab._hooks import passive
from opsnn_lab.fusion import checkpointing
from opsnn_lab.fusion.graph import (
    Graph,
    Node,
    Ref,
    canonical_function,
    canonical_module,
    is_leaf_module,
)
from opsnn_lab.fusion.instance import plain_object
from opsnn_lab.fusion.probe import probe_modules
from opsnn_lab.fusion.wrappers import ArgumentState, RecordedCall
from opsnn_lab.measuring import pack_detached

__all__ = ["RuntimeTrace", "ModuleCall", "trace_runtime", "flatten_tensors", "own_dtypes", "graph_free_memo"]


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``; -1 for an inference tensor, which tracks none (under ``torch.inference_mode`` nothing
    writes into one behind the caller's back)."""
    return -1 if t.is_inference() else t._version


def _first_tensor(args) -> tuple | None:
    """The first positional tensor argument and its version counter, to tell a write into it (the call returns
    it with its version moved: ``relu_``, ``+=``, ``inplace=True``) from a pass-through (``nn.Identity``)."""
    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return None if t is None else (t, tensor_version(t))


@dataclass
class ModuleCall:
    """One call of one module: the tensors it read and returned, and the nodes recorded while it ran."""

    path: str
    inputs: list[str]  # producer names of its tensor arguments, in order ('' for a tensor made elsewhere)
    outputs: list[str]  # producer names of the tensors it returned
    start: int  # nodes[start:end] ran inside this call
    end: int
    bare: bool  # it returned one tensor, not a tuple / dict / dataclass
    n_args: int  # positional arguments
    kwargs: tuple  # keyword argument names


@dataclass
class RuntimeTrace:
    graph: Graph
    saved: list[tuple[str, object, int]]  # (node name, storage key, bytes) for every saved activation
    calls: dict[str, list[tuple[tuple, dict]]]  # module path -> (args, kwargs) of each call
    output: object = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # node name -> first output tensor
    module_calls: list[ModuleCall] = field(default_factory=list)  # every call of a model module, in order
    # modules holding parameters that the forward neither called nor read a parameter of (uppermost paths):
    # layers a layerdrop or a branch skipped; nothing of them is in the record
    not_called: list[str] = field(default_factory=list)
    # node name -> the torch.utils.checkpoint call it ran inside (run as a plain call while recording:
    # checkpointing.py), for the nodes that did; a save no recorded op made -> its call or checkpointed layer
    checkpointed: dict[str, int | str] = field(default_factory=dict)
    # nodes recorded with gradients off (a ``torch.no_grad()`` block in the forward): nothing of them is saved
    without_grad: frozenset[str] = frozenset()
    # nodes whose autograd node nothing held once the forward returned (a computation it dropped): what they saved
    # was freed before backward (``dropped_by_forward``)
    dropped: frozenset[str] = frozenset()

    def calls_of(self, path: str) -> list[ModuleCall]:
        return [c for c in self.module_calls if c.path == path]

    def storage_of(self, name: str):
        t = self.tensors.get(name)
        return None if t is None else _storage_key(t)


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), t.device.type, t.device.index) if s.data_ptr() else ("id", id(s))
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def flatten_tensors(value, out=None) -> list[torch.Tensor]:
    """Tensors inside tuples, lists, dicts, dataclasses and plain objects (a model's output, any style)."""
    out = [] if out is None else out
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            flatten_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            flatten_tensors(v, out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            flatten_tensors(getattr(value, f.name), out)
    return out


def graph_free_memo(*modules: nn.Module) -> dict:
    """A ``copy.deepcopy`` memo giving every tensor a forward left in an attribute of ``modules`` (or their
    submodules) with its autograd graph a detached copy: a recurrent-state cache (RecurrentGemma's
    ``recurrent_states`` and ``conv1d_state``) would make deepcopy raise, and a copy has no use for the graph (its
    next forward writes the cache again). Parameters are leaves and go through deepcopy as usual."""
    memo: dict = {}
    for module in modules:
        for m in module.modules():
            for key, value in vars(m).items():
                if key in ("_parameters", "_modules"):
                    continue
                for t in _held_tensors(value):
                    if not t.is_leaf and id(t) not in memo:
                        memo[id(t)] = t.detach().clone()
    return memo


def _held_tensors(value, depth: int = 0, seen: set | None = None):
    """Tensors in an attribute value, in the lists, tuples, sets and dicts it holds and in the instance attributes of
    the other objects it holds (OmDet-Turbo's LRU caches of text embeddings: an object around an OrderedDict), four
    levels deep. Only what ``vars`` holds is read: a property is never called (a config's may raise when read:
    Gemma-4's per-layer ``head_dim``). Modules are walked by the caller; classes, functions and Python modules are
    not containers (``instance.plain_object``)."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    seen = set() if seen is None else seen
    if depth >= 4 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    elif plain_object(value):  # not a module (the caller walks those), class, function, Python module
        items = list(vars(value).values())
    else:  # no instance dict (ints, strings, slotted objects)
        return
    for v in items:
        yield from _held_tensors(v, depth + 1, seen)


def buffers_kept(model: nn.Module):
    """A function putting every buffer of ``model`` back as it is now: running the model's code to analyse or rewrite
    it moves BatchNorm statistics, a spectral norm's power iteration, counts."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore() -> None:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)

    return restore


@contextlib.contextmanager
def own_dtypes(model: nn.Module, *values):
    """Autocast off on every device the model and ``values`` live on (and the CPU): inside, a forward, a probe
    or a fused op runs in the model's own dtypes. ``analyze`` records under it, so a plan made inside a
    ``torch.autocast`` region is the plan made outside it (the fused ops apply autocast's casts themselves)."""
    kinds = {"cpu"} | {t.device.type for t in [*model.parameters(), *model.buffers(), *flatten_tensors(list(values))]}
    with contextlib.ExitStack() as stack:
        for kind in sorted(kinds):
            if torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


# Conversions that return their input itself when there is nothing to do. Recording them would hand the
# tensor a second producer inside whichever module ran the cast (HF norms start with ``x.to(float32)``), so a
# residual read of the module's input would look like a read of its inside.
_NO_OP_CASTS = frozenset({"to", "contiguous", "float", "type_as", "type"})


# Calls that read a tensor's metadata, not its values (``p.device`` is ``__get__``): a module whose parameters only
# these touched (make_reproducible looks at every parameter's device) did not run.
_METADATA = frozenset({"__get__", "size", "dim", "numel", "stride", "is_contiguous", "data_ptr", "element_size",
                       "nelement", "is_floating_point", "get_device", "untyped_storage", "storage_offset"})


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module, checkpointed: tuple[str, ...] = ()):
        super().__init__()
        self.checkpointed_layers = tuple(checkpointed)  # layers whose checkpoint the flags-off record leaves out
        self.paths = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), name)
        self.nodes: list[Node] = []
        self.producer: dict[int, str] = {}  # id(tensor) -> node name
        self.keep: list[torch.Tensor] = []  # keeps ids unique for the trace's lifetime
        self.tensors: dict[str, torch.Tensor] = {}
        self.scope: list[str] = [""]
        self.leaf_depth = 0
        self.first_arg = None  # (tensor, version) of the leaf module call running
        self.current: list[str] = ["<outside>"]
        self.saved: list[tuple[str, object, int]] = []
        self.calls: dict[str, list] = {}
        self.counts: dict[str, int] = {}
        self.param_storages = {_storage_key(p) for p in model.parameters()}
        self.module_calls: list[ModuleCall] = []
        self.records: dict[int, RecordedCall] = {}  # index in module_calls -> its call in ``calls``, until it returns
        self.open_calls: list[tuple[int, int] | None] = []  # (index in module_calls, first node index)
        self.called: set[int] = set()  # id of every module called, inside built-in modules too
        self.read: set[int] = set()  # id of every Parameter a recorded function call read
        # nodes made inside a torch.utils.checkpoint call -> the call; saves no op made there (``_saver``) -> the call
        # or checkpointed layer
        self.checkpointed: dict[str, int | str] = {}
        self.without_grad: set[str] = set()  # nodes made with gradients off
        # node name -> (its outputs, their autograd nodes as it made them): ``dropped_by_forward``
        self.grad_fns: dict[str, tuple[list, list]] = {}

    # -- tensors ----------------------------------------------------------------------------------------
    def _refs(self, value):
        if isinstance(value, torch.Tensor):
            name = self.producer.get(id(value))
            return Ref(name) if name else ("param" if isinstance(value, nn.Parameter) else "tensor")
        if isinstance(value, (list, tuple)):
            return type(value)(self._refs(v) for v in value) if not hasattr(value, "_fields") else value
        return value

    def _inputs(self, args, kwargs) -> list[str]:
        names = []
        for t in flatten_tensors([list(args), kwargs]):
            name = self.producer.get(id(t))
            if name:
                names.append(name)
        return names

    def _new(self, base: str) -> str:
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return base if n == 0 else f"{base}#{n + 1}"

    def _add(self, node: Node, output, written=None) -> None:
        if (call := checkpointing.current()) is not None:
            self.checkpointed[node.name] = call
        if not torch.is_grad_enabled():
            self.without_grad.add(node.name)
        outs = flatten_tensors(output)
        if outs:
            t = outs[0]
            node.inplace = written is not None and t is written[0] and tensor_version(t) != written[1]
            node.shape, node.dtype = tuple(t.shape), t.dtype
            node.nbytes = t.numel() * t.element_size()
            self.tensors[node.name] = t
        for t in outs:
            self.producer[id(t)] = node.name
            self.keep.append(t)
        if outs and torch.is_grad_enabled():
            self.grad_fns[node.name] = (outs, [f for f in map(_grad_fn, outs) if f is not None])
        self.nodes.append(node)
        if len(outs) > 1:
            self._items(node, outs)

    def _items(self, node: Node, outs: list[torch.Tensor]) -> None:
        """One ``getitem`` node per tensor of a call that returned several (``split``, ``chunk``, ``var_mean``, a
        module's tuple), as fx records them: a reader of the second half reads that half (its shape, dtype and
        values), not the first one under the call's name. The index is the tensor's place in the flattened output."""
        for i, t in enumerate(outs):
            if self.producer.get(id(t)) != node.name:
                continue  # returned twice: one item for it
            scope = node.scope
            item = Node(name=self._new(f"{scope + '.' if scope else ''}getitem"), kind="function", op="getitem",
                        inputs=[node.name], args=(Ref(node.name), i), scope=scope)
            self._add(item, t)

    def add_inputs(self, args, kwargs) -> None:
        for i, t in enumerate(flatten_tensors([list(args), kwargs])):
            self._add(Node(name=f"input{i}", kind="input", op="input"), t)

    # -- functions --------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA:
            for a in (*args, *kwargs.values()):  # nn.LSTM passes its weights as a list
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, nn.Parameter):
                        self.read.add(id(t))
        if self.leaf_depth:
            return func(*args, **kwargs)
        op = canonical_function(func)
        if getattr(func, "__name__", "") in _NO_OP_CASTS:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and any(out is a for a in args[:1]):
                return out  # x.to(x.dtype), x.contiguous() on a contiguous x: the same tensor, nothing computed
            return self._record(func, op, args, kwargs, precomputed=out)
        return self._record(func, op, args, kwargs)

    def _record(self, func, op, args, kwargs, precomputed=None):
        name = self._new(f"{self.scope[-1] + '.' if self.scope[-1] else ''}{op}")
        self.current.append(name)
        first = _first_tensor(args)
        try:
            out = func(*args, **kwargs) if precomputed is None else precomputed
        finally:
            self.current.pop()
        if flatten_tensors(out) or op == "setitem":  # item assignment consumes a tensor, returns None
            node = Node(name=name, kind="function", op=op, inputs=self._inputs(args, kwargs),
                        args=tuple(self._refs(a) for a in args), kwargs={k: self._refs(v) for k, v in kwargs.items()},
                        scope=self.scope[-1])
            self._add(node, out, first)
        return out

    # -- modules ----------------------------------------------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        self.called.add(id(module))
        if self.leaf_depth:
            self.leaf_depth += 1
            return
        path = self.paths.get(id(module))  # None: a module built inside forward, not part of the model
        if path is not None:
            first = path not in self.calls  # its objects' state (a cache) as the call found it, for a replay
            state = ArgumentState([*args, *kwargs.values()]) if first else None
            record = RecordedCall(args, kwargs, state if state and state.items else None)
            self.calls.setdefault(path, []).append(record)
            if path in self.checkpointed_layers and \
                    checkpointing.holder(self.scope[-1], self.checkpointed_layers) is None:
                # its checkpoint keeps its positional inputs, as its wrapper calls it; inside another checkpointed
                # layer (Swin's layers in its stages) they go with that one's activations
                checkpointing.save_inputs(args)
            self.records[len(self.module_calls)] = record
            ins = [self.producer.get(id(t), "") for t in flatten_tensors([list(args), kwargs])]
            self.module_calls.append(ModuleCall(path, ins, [], len(self.nodes), -1, False, len(args), tuple(kwargs)))
            self.open_calls.append(len(self.module_calls) - 1)
        else:
            self.open_calls.append(None)
        if is_leaf_module(module):
            self.leaf_depth = 1
            where = f"{self.scope[-1]}.<{type(module).__name__}>" if path is None else (path or "<root>")
            self.current.append(self._new(where))
            self.first_arg = _first_tensor(args)
        else:
            self.scope.append(self.scope[-1] if path is None else path)

    def post_hook(self, module, args, kwargs, output):
        if self.leaf_depth > 1:
            self.leaf_depth -= 1
            return
        if self.leaf_depth == 0:
            self.scope.pop()
            self._close(output)
            return
        self.leaf_depth = 0
        name = self.current.pop()
        node = Node(name=name, kind="module", op=canonical_module(module), inputs=self._inputs(args, kwargs),
                    args=tuple(self._refs(a) for a in args), kwargs={k: self._refs(v) for k, v in kwargs.items()},
                    module=self.paths.get(id(module)), scope=self.scope[-1], obj=module)
        self._add(node, output, self.first_arg)
        self._close(output)

    def _close(self, output) -> None:
        index = self.open_calls.pop() if self.open_calls else None
        if index is not None:
            call = self.module_calls[index]
            call.end, call.bare = len(self.nodes), isinstance(output, torch.Tensor)
            record = self.records.pop(index, None)
            if record is not None:
                record.bare = call.bare
            call.outputs = [self.producer.get(id(t), "") for t in flatten_tensors(output)]

    def pack(self, t: torch.Tensor, saver: str | None = None):
        if not isinstance(t, nn.Parameter):
            key = _storage_key(t)
            if key not in self.param_storages:
                self.saved.append((saver or self._saver(), key, t.untyped_storage().nbytes()))
        return t

    def _saver(self) -> str:
        """The op saving a tensor now; "<outside>" when no recorded op runs (an autograd Function's ``forward``
        saving its own tensors), named for where it runs when that is a checkpoint: nothing of it is kept."""
        if (saver := self.current[-1]) != "<outside>":
            return saver
        scope = self.scope[-1]
        unit = checkpointing.holder(scope, self.checkpointed_layers)
        unit = unit if unit is not None else checkpointing.current()
        if unit is None:
            return saver
        saver = f"<outside> {scope or '<model>'}"
        self.checkpointed[saver] = unit
        return saver

    def checkpoint_input(self, t: torch.Tensor) -> None:
        """What a checkpoint keeps of its inputs, which the record runs plain (checkpointing.py)."""
        self.pack(t, "<checkpoint>")


def _weak_pack(rec: _Recorder):
    """``rec.pack`` through a weak reference, returning a detached alias (``measuring.pack_detached``). Every tensor
    saved under a ``saved_tensors_hooks`` pair keeps the pair and what pack returned for as long as its autograd
    graph lives: a pack hook holding the recorder (which holds the forward's tensors), or returning an op's own
    output (``rsqrt``, ``exp`` save theirs), made a cycle through C++ that Python's collector cannot see, and each
    analysis kept its example forward, activations and parameters for good (the 223-architecture sweep reached
    22 GB and was killed once)."""
    ref = weakref.ref(rec)

    def pack(t):
        recorder = ref()
        if recorder is not None:
            recorder.pack(t)
        return pack_detached(t)

    return pack


def trace_runtime(model: nn.Module, args: tuple, kwargs: dict | None = None,
                  checkpointed: tuple[str, ...] = ()) -> RuntimeTrace:
    """Run ``model(*args, **kwargs)`` once and return its dataflow graph (the model runs as is). ``checkpointed``:
    layers whose checkpointing is off for the record (``checkpointing.suspended``), whose inputs their checkpoint
    would keep."""
    kwargs = kwargs or {}
    probe_modules(model)  # before any hook: the probe runs modules, which the record must not see
    rec = _Recorder(model, checkpointed)
    rec.add_inputs(args, kwargs)
    pre_hook, post_hook = passive(rec.pre_hook), passive(rec.post_hook)  # record what runs, fused regions too
    pre = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in model.modules()]
    post = [m.register_forward_hook(post_hook, with_kwargs=True, always_call=True) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(_weak_pack(rec), lambda t: t), rec, \
                checkpointing.saving_inputs(rec.checkpoint_input):
            output = model(*args, **kwargs)
    finally:
        for h in pre + post:
            h.remove()
    dropped = dropped_by_forward(rec, model, output, (args, kwargs))
    rec.grad_fns.clear()
    outs = [rec.producer[id(t)] for t in flatten_tensors(output) if id(t) in rec.producer]
    rec.nodes.append(Node(name="output", kind="output", op="output", inputs=outs))
    graph = Graph(rec.nodes)
    graph.tensors = rec.tensors  # the same dict: cleared with trace.tensors once the analysis is done
    graph.modules = {path: m for path, m in model.named_modules()}
    return RuntimeTrace(graph, rec.saved, rec.calls, output, rec.tensors, rec.module_calls,
                        _not_called(model, rec.called, rec.read), rec.checkpointed, frozenset(rec.without_grad),
                        dropped)


def dropped_by_forward(rec: _Recorder, model: nn.Module, output, inputs) -> frozenset[str]:
    """The recorded nodes whose autograd nodes nothing holds once the forward returns:
    a computation the forward made and dropped (RT-DETR's decoder refines its boxes once more after the last layer
    and reads the result only through ``detach``). Held: what the graph of the output, of the inputs and of a tensor
    left in a module's attributes (a recurrent state) reaches. What the dropped nodes saved is freed before
    backward, as ``measuring.activation_bytes`` finds it; and a fused region's code does not compute them at all."""
    savers = {name for name, _, _ in rec.saved}
    if not savers & rec.grad_fns.keys():
        return frozenset()  # nothing saved with gradients on
    roots = [*_held_tensors(output), *flatten_tensors(output), *flatten_tensors(inputs)]
    for m in model.modules():
        for key, value in vars(m).items():
            if key not in ("_parameters", "_modules"):
                roots.extend(_held_tensors(value))
    held: set = set()
    todo = [_grad_fn(t) for t in roots if isinstance(t, torch.Tensor)]
    while todo:
        fn = todo.pop()
        if fn is None or fn in held:
            continue
        held.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    # dropped: neither the autograd nodes its outputs had when made nor those they have now (an op writing into an
    # output in place, an in-place activation after an InstanceNorm's view, makes a new one) are held, nor the
    # nodes under their views (Funnel's einsum returns a view of a bmm's output, which an in-place write through
    # another view re-bases: the bmm, which holds the saves, is held through the base)
    # A node that saved for backward and returned nothing with an autograd node (``torch.isfinite(x)``, which takes
    # ``x.abs()`` inside: RT-DETR's encoder checks its output so) saved for nodes nothing can reach: dropped too
    return frozenset(name for name, (outs, made) in rec.grad_fns.items()
                     if (made or name in savers) and not _under_views([*made, *map(_grad_fn, outs)]) & held)


def _grad_fn(t: torch.Tensor):
    """``t.grad_fn``; None where reading it raises: a view of several a function returned (``unbind``) whose base was
    written in place since (CogView4's rotary embedding), which autograd refuses to re-base."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


# autograd nodes of ops whose output views their input: they save nothing, the node under them holds the saves
_VIEW_NODES = frozenset({"ViewBackward0", "AsStridedBackward0", "AsStridedBackward1", "TransposeBackward0",
                         "TransposeBackward1", "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0",
                         "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SliceBackward0",
                         "SelectBackward0", "ReshapeAliasBackward0", "TBackward0", "AliasBackward0",
                         "UnfoldBackward0", "DiagonalBackward0", "SplitBackward0", "SplitWithSizesBackward0",
                         "UnbindBackward0", "ViewAsRealBackward0", "ViewAsComplexBackward0", "NarrowBackward0"})


def _under_views(fns) -> set:
    """``fns`` and, under each that only views its input, the nodes under it, down to ones that do more."""
    out, todo = set(), [f for f in fns if f is not None]
    while todo:
        fn = todo.pop()
        if fn in out:
            continue
        out.add(fn)
        if type(fn).__name__ in _VIEW_NODES:
            todo.extend(f for f, _ in fn.next_functions if f is not None)
    return out


def _not_called(model: nn.Module, called: set[int], read: set[int]) -> list[str]:
    """Uppermost modules holding parameters of which nothing ran: neither it nor a module inside was called,
    and no recorded call read one of its parameters (a Parameter used functionally by its parent counts)."""
    out: list[str] = []

    def visit(path: str, module: nn.Module) -> bool:  # True: something of it ran
        ran = id(module) in called or any(id(p) in read for p in module.parameters(recurse=False))
        skipped = []
        for name, child in module.named_children():
            sub = f"{path}.{name}" if path else name
            if visit(sub, child):
                ran = True
            elif any(True for _ in child.parameters()):
                skipped.append(sub)
        if ran:
            out.extend(skipped)
        return ran

    if not visit("", model) and any(True for _ in model.parameters()):
        out.append("")
    return out
