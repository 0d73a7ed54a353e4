"""Operator-level recording of a training step: every ATen op of forward and backward, by module path.

``OpTracer`` is a ``TorchDispatchMode`` (sees every ATen op below autograd, forward and backward)
plus global module forward hooks (which module is running). Backward ops are attributed through the
autograd node that runs them: while the forward runs, each new node's sequence number is mapped to the
module path and source line of the op that created it; in backward ``torch._C._current_autograd_node()``
names the node, so a backward op lands on the same module path as its forward op.

Tensors are held by reference while tracing (no copies on the hot path); an in-place op on a held
tensor first swaps the held one for a copy (copy-on-write). At exit the leaves (parameters, user
inputs) and parameter gradients are copied, because an optimizer step mutates them later, unless the
caller uses the trace right away and says so (``copy_leaves=False``: the checker's compared steps). Statistics and
the bitwise hash are computed once per tensor at exit, the small ones together (``stats.summarize_many``).
With ``memory_limit``, the records hold tensors (distinct storages, counted once) until the next event would
pass the limit; from that event on, each is summarised as it is recorded and holds none (``OpRecord.summarised``).
The records themselves (``OpRecord``, ``Trace``) live in ``records.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections import defaultdict
from typing import NamedTuple

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from opsnn_lab._checks import check_bytes
from opsnn_lab.consistency.gemm_probe import one_thread
from opsnn_lab.consistency.records import (
    OpRecord,
    Trace,
    flatten,
    portable,
    restore,
    summarize_like,
    summarize_records,
    unflatten,
)
from opsnn_lab.consistency.stats import TensorStats, summarize, tensor_hash

__all__ = ["TensorStats", "OpRecord", "Trace", "OpTracer", "summarize", "tensor_hash", "flatten", "unflatten",
           "portable", "restore"]

_aten = torch.ops.aten
# Ops whose output holds no computed value (uninitialised memory, metadata) or that are pure data movement
# of the same bits: recording them only adds noise (``empty`` differs between runs by construction).
_SKIP = {
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.resize_.default, _aten.set_.source_Storage_storage_offset,
    _aten.lift_fresh.default, _aten._local_scalar_dense.default, _aten.is_same_size.default,
    _aten._unsafe_view.default,  # aliases its input's storage: the producer stays the op that computed it
}
# allocation ops: their outputs hold no value yet, so they are neither leaves nor divergences
_FRESH = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
          _aten.new_empty.default, _aten.new_empty_strided.default}
_current_node = torch._C._current_autograd_node
# frames in these directories are never "the user's code" when naming a source location
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


# --------------------------------------------------------------------------- the tracer
def _user_location() -> str:
    """``file:line`` of the innermost frame outside torch and this package's consistency code."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_INTERNAL) and not fn.startswith("<frozen"):
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return "<unknown>"


class _OpInfo(NamedTuple):
    passthrough: bool     # a view or a _SKIP op: run, not recorded
    fresh: bool           # an allocation (_FRESH)
    name: str             # "aten.addmm.default"
    written: tuple | None  # (position, name) of the arguments it writes; None for an op that writes nothing
    op: object            # the op itself: keeps it alive, so its id is never reused for another


_infos: dict[int, _OpInfo] = {}


def _op_info(func) -> _OpInfo:
    """What the dispatch mode needs to know about ``func``, worked out once per op.

    Keyed by ``id``: ``OpOverload.__hash__`` is Python code, and this lookup runs on every dispatched op.
    """
    info = _infos.get(id(func))
    if info is None:
        written = None
        if func._schema.is_mutable:
            written = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
        info = _infos[id(func)] = _OpInfo(bool(func.is_view) or func in _SKIP, func in _FRESH, str(func),
                                          written, func)
    return info


def _written_storages(written: tuple, args, kwargs) -> set:
    keys = set()
    for i, name in written:
        a = args[i] if i < len(args) else kwargs.get(name)
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                keys.add(_storage_key(t))
    return keys


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off inside the block (as it was before, after it).

    A traced step allocates a few Python objects per op (records, argument lists, statistics); with the
    collector on, every ~700 of them start a collection that walks all objects young enough, and now and
    then all of them (hundreds of thousands once torch is imported): 5-10% of a traced step. Nothing the
    tracer allocates is cyclic garbage, so the collections find nothing; cycles the traced code itself
    makes are collected after the block.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Mode(TorchDispatchMode):
    def __init__(self, tracer: OpTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tracer
        if tr._quiet:
            return func(*args, **kwargs)
        info = _op_info(func)
        node = _current_node()
        if info.passthrough:
            if node is None:  # its backward node still belongs to this module
                tr._map_node(tr._stack[-1] if tr._stack else "", None)
            out = func(*args, **kwargs)
            if info.fresh:
                tr._producer[_storage_key(out)] = -1
            return out
        if node is not None and not tr.check_gradients:
            return func(*args, **kwargs)
        flat: list = []
        spec = flatten((args, kwargs), flat)
        slots = _tensor_slots(flat)
        keys = [_storage_key(flat[i]) for i in slots]
        producers = [tr._producer.get(k) for k in keys]
        if info.written is not None:  # keep the pre-mutation inputs, and protect held tensors from the write
            # only the storages the op writes: its other inputs keep their bits, and a later write to
            # them is caught by the copy-on-write of the records that hold them
            hit = _written_storages(info.written, args, kwargs) if info.written else None
            for i, k, prod in zip(slots, keys, producers):
                if hit is None or k in hit:
                    if prod is None and k is not None:  # a leaf written in place (a buffer): see _freeze
                        tr._written_leaves.add(k)
                    tr._copy_on_write(k)
                    # past the memory limit the record keeps only its leaf inputs' statistics: no other copy
                    if not tr._full or prod is None:
                        flat[i] = flat[i].detach().clone()
        out = func(*args, **kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else [
            o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if outs:
            tr._record_op(info.name, flat, spec, slots, keys, producers, outs, node)
        return out


class OpTracer:
    """Context manager recording one step; the result is ``tracer.trace`` (a ``Trace``)."""

    def __init__(self, model: torch.nn.Module | None = None, *, check_gradients: bool = True,
                 copy_leaves: bool = True, reference: Trace | None = None, memory_limit: int | str | None = None):
        self.model = model
        # bytes of distinct storages the records may hold; from the first event past it on, each event is
        # summarised as it is recorded and keeps statistics and hashes only (None: hold every tensor)
        self.memory_limit = check_bytes("memory_limit", memory_limit, allow_none=True)
        self.held_bytes = 0
        self._counted: set = set()
        self._full = False
        self._quiet = False  # summarising: ops pass through unrecorded
        self._written_leaves: set = set()  # storages of leaves (buffers) an op wrote in place
        self._ref_keys: dict | None = None
        # the trace this one will be compared with: tensors with its bits take its statistics (hashes only)
        self.reference = reference
        self.check_gradients = check_gradients
        # False: leaves and parameter gradients stay the live tensors (the trace marks them, and
        # ``Trace.save`` refuses to write them once they changed); saves copying every parameter and
        # gradient per traced step, which the checker only needs for the trace it keeps as reference
        self.copy_leaves = copy_leaves
        self.records: list[OpRecord] = []
        self.trace: Trace | None = None
        self._names: dict[int, str] = {}
        self._roots: list[tuple[str, torch.nn.Module]] = []
        self._stack: list[str] = []
        self._count: dict[tuple, int] = defaultdict(int)
        self._producer: dict[int, int] = {}        # storage pointer -> index of the record that last wrote it
        self._held: dict[int, list] = defaultdict(list)  # storage pointer -> [(list, position)] holding it
        self._nodes: dict[int, tuple] = {}         # autograd sequence nr -> (module path, location, fwd index)
        self._seq_start = 0
        self._last_loc: dict[str, str] = {}
        self._pnames: dict[int, str] | None = None
        self._pnames_roots = 0
        if model is not None:
            self._register_root("", model)

    # ----------------------------------------------------------------- module paths
    def _register_root(self, name: str, module: torch.nn.Module) -> None:
        self._roots.append((name, module))
        for sub, m in module.named_modules():
            self._names.setdefault(id(m), f"{name}.{sub}" if name and sub else (sub or name))

    def _path_of(self, module: torch.nn.Module) -> str:
        path = self._names.get(id(module))
        if path is None:
            parent = self._stack[-1] if self._stack else None
            if parent is None:
                root = "" if not self._roots else f"<{type(module).__name__}>"
                self._register_root(root, module)
            else:  # a module called from inside the traced model that its named_modules() does not list
                self._names[id(module)] = f"{parent}.<{type(module).__name__}>"
            path = self._names[id(module)]
        return path

    def _pre_hook(self, module, args):
        self._stack.append(self._path_of(module))

    def _post_hook(self, module, args, output):
        path = self._stack.pop() if self._stack else self._path_of(module)
        outs = [o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor)]
        if outs and torch._C._current_autograd_node() is None:
            self._append(OpRecord(0, "forward", "module", type(module).__name__, path, _user_location()),
                         outs)

    # ----------------------------------------------------------------- recording
    def _append(self, rec: OpRecord, outs: list[torch.Tensor], slots=(), keys=()) -> OpRecord:
        rec.index = len(self.records)
        k = (rec.phase, rec.kind, rec.module_path, rec.op)
        rec.occurrence = self._count[k]
        self._count[k] += 1
        out_keys = [_storage_key(t) for t in outs]
        if rec.kind == "op":
            for p in out_keys:
                if p is not None:
                    self._producer[p] = rec.index
        self.records.append(rec)
        if self.memory_limit is not None and not self._fits(rec, outs, keys, out_keys):
            self._summarise_now(rec, outs)
            return rec
        held = self._held
        for i, p in zip(slots, keys):
            if p is not None:
                held[p].append((rec.flat_args, i))
        rec.outputs = list(outs)
        for i, p in enumerate(out_keys):
            if p is not None:
                held[p].append((rec.outputs, i))
        return rec

    def _fits(self, rec: OpRecord, outs: list, keys, out_keys) -> bool:
        """Whether the trace may hold this event's tensors too (counted once per storage); once one event does
        not fit, none after it is held either (the trace keeps a prefix of the step: its first divergence,
        most often)."""
        if self._full:
            return False
        new = {}
        for t, p in zip([*rec.input_tensors(), *outs], [*keys, *out_keys]):
            key = p if p is not None else id(t)
            if key not in self._counted and key not in new:
                new[key] = t.untyped_storage().nbytes() if p is not None else t.numel() * t.element_size()
        extra = sum(new.values())
        if self.held_bytes + extra > self.memory_limit:
            self._full = True
            return False
        self.held_bytes += extra
        self._counted.update(new)
        return True

    def _summarise_now(self, rec: OpRecord, outs: list[torch.Tensor]) -> None:
        """Statistics and hashes of the event's outputs and leaf inputs now; its tensors are not kept."""
        ref = None
        if self.reference is not None:
            if self._ref_keys is None:
                self._ref_keys = self.reference.by_key()
            ref = self._ref_keys.get(rec.key)
        leaves = [t for t, p in zip(rec.input_tensors(), rec.input_producers) if p is None]
        theirs = [None] * (len(outs) + len(leaves))
        if ref is not None:
            mine = [i for i, p in enumerate(rec.input_producers) if p is None]
            theirs = [*(ref.output_stats + [None] * len(outs))[:len(outs)],
                      *[ref.input_stats[i] if i < len(ref.input_stats) else None for i in mine]]
        # a module hook calls this too, under the dispatch mode: these reductions are not the step's ops
        self._quiet = True
        try:
            with torch.no_grad():
                stats = summarize_like([t.detach() for t in [*outs, *leaves]], theirs)
        finally:
            self._quiet = False
        rec.output_stats = stats[:len(outs)]
        rest = iter(stats[len(outs):])
        rec.input_stats = [next(rest) if p is None else None for p in rec.input_producers]
        rec.flat_args = rec.spec = rec.outputs = None
        rec.summarised = True

    def _record_op(self, name, flat, spec, slots, keys, producers, outs, node) -> None:
        if node is None:
            path = self._stack[-1] if self._stack else ""
            loc = _user_location()
            rec = OpRecord(0, "forward", "op", name, path, loc)
            self._map_node(path, loc)
            self._last_loc[path] = loc
        else:
            path, loc, fwd = self._node_owner(node)
            rec = OpRecord(0, "backward", "op", name, path, loc, forward_index=fwd)
        rec.input_producers, rec.flat_args, rec.spec = producers, flat, spec
        self._append(rec, outs, slots, keys)

    def _map_node(self, path: str, loc: str | None) -> None:
        # the autograd node an op creates is numbered just before the op reaches this dispatch mode
        seq = torch._C._autograd._get_sequence_nr() - 1
        if seq >= self._seq_start and seq not in self._nodes:
            self._nodes[seq] = (path, loc, len(self.records) if loc is not None else None)

    def _node_owner(self, node) -> tuple:
        owner = self._nodes.get(node._sequence_nr())
        if owner is not None:
            if owner[1] is None:  # created by a view op: the module's last recorded source line
                return owner[0], self._last_loc.get(owner[0], "<unknown>"), None
            return owner
        var = getattr(node, "variable", None)  # AccumulateGrad: the parameter it accumulates into
        full = self._param_names().get(id(var)) if var is not None else None
        if full is not None:
            return full.rpartition(".")[0], "<autograd>", None
        return "<autograd>", "<autograd>", None

    def _param_names(self) -> dict[int, str]:
        if self._pnames is None or self._pnames_roots != len(self._roots):
            self._pnames = {}
            for root, m in self._roots:
                for pname, p in m.named_parameters():
                    self._pnames.setdefault(id(p), f"{root}.{pname}" if root else pname)
            self._pnames_roots = len(self._roots)
        return self._pnames

    def _copy_on_write(self, key) -> None:
        """Before a write to storage ``key``: every held tensor over it is swapped for a copy."""
        for lst, i in self._held.pop(key, ()):
            lst[i] = lst[i].clone()
            if self.memory_limit is not None:  # a copy the step would not have made: it counts (not refused)
                self.held_bytes += lst[i].numel() * lst[i].element_size()

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> OpTracer:
        self._gc = gc_paused()
        self._gc.__enter__()
        self._seq_start = torch._C._autograd._get_sequence_nr()
        self._handles = [register_module_forward_pre_hook(self._pre_hook),
                         register_module_forward_hook(self._post_hook, always_call=True)]
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
            for h in self._handles:
                h.remove()
            if exc[0] is None:
                self._finish()
        finally:
            # the mode refers to the tracer, and the mode outlives its exit (the tracer refers to it, and
            # torch may keep the last mode): without this link cut, a finished trace (every tensor of its
            # step) lives until the cycle collector runs, or longer, not until its owner drops it
            self._mode.tracer = None
            self._mode = self._handles = None
            self._gc.__exit__(None, None, None)

    def _finish(self) -> None:
        if self.check_gradients:
            self._record_param_grads()
        with one_thread():  # many small copies: a thread-pool fork/join each costs more than the copy
            live = self._freeze()
        summarize_records(self.records, self.reference)
        self.trace = Trace(self.records, live=live, memory_limit=self.memory_limit)
        self._held.clear()
        self._written_leaves.clear()
        self._producer.clear()
        self._nodes.clear()

    def _record_param_grads(self) -> None:
        params = {id(p): p for _, m in self._roots for p in m.parameters()}
        for pid, full in self._param_names().items():
            p = params.get(pid)
            if p is not None and p.grad is not None:
                path, _, leaf = full.rpartition(".")
                self._append(OpRecord(0, "backward", "grad", f"grad.{leaf}", path, "<autograd>"), [p.grad])

    def _freeze(self) -> list:
        """Copy what outlives the step and will change: leaves (parameters, inputs) and parameter grads.

        Without ``copy_leaves`` they stay as they are; returns them with their version counters then
        (empty when copied), so that the trace can tell later whether they still hold the step's values.
        """
        if not self.copy_leaves:
            return self._mark_live()
        # gradients, and op outputs over a leaf written in place (a buffer: BatchNorm's num_batches_tracked.add_),
        # change with the next step as the leaves do
        kept = {_storage_key(r.outputs[0]) for r in self.records if r.kind == "grad" and not r.summarised}
        kept |= self._written_leaves
        copies: dict[int, torch.UntypedStorage] = {}
        for rec in self.records:
            if rec.summarised:
                continue
            if rec.flat_args:
                for slot, prod in zip(_tensor_slots(rec.flat_args), rec.input_producers):
                    t = rec.flat_args[slot]
                    if prod is None or _storage_key(t) in kept:
                        rec.flat_args[slot] = _copy_view(t, copies)
            for i, t in enumerate(rec.outputs):
                rec.outputs[i] = _copy_view(t, copies) if _storage_key(t) in kept else t.detach()
        return []

    def _mark_live(self) -> list:
        """The leaves and parameter gradients, kept as they are, with their version counters."""
        live: dict[int, torch.Tensor] = {}
        leaves = self._written_leaves
        for rec in self.records:
            if rec.summarised:
                continue
            if rec.flat_args:
                for slot, prod in zip(_tensor_slots(rec.flat_args), rec.input_producers):
                    if prod is None:
                        t = rec.flat_args[slot]
                        live.setdefault(id(t), t)
                        rec.flat_args[slot] = t.detach()
            outs = rec.outputs
            for i, t in enumerate(outs):
                outs[i] = t.detach()  # shares the version counter: a later write still shows
                if _storage_key(t) in leaves:  # a buffer updated in place: the next step changes it
                    live.setdefault(id(outs[i]), outs[i])
            if rec.kind == "grad":
                live.setdefault(id(outs[0]), outs[0])
        return [(t, t._version) for t in live.values()]



def _copy_view(t: torch.Tensor, copies: dict) -> torch.Tensor:
    """``t`` over a private copy of its storage (one copy per storage, however many views use it)."""
    key = _storage_key(t)
    if key is None:
        return t.detach().clone()
    storage = copies.get(key)
    if storage is None:
        storage = copies[key] = t.untyped_storage().clone()
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(storage, t.storage_offset(), t.shape, t.stride())


def _tensor_slots(flat: list) -> list[int]:
    return [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
