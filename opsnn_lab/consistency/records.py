"""What a traced step is made of: ``OpRecord`` per event, ``Trace`` (save/load), and the helpers that keep
recorded arguments (``flatten``/``unflatten``, ``portable``/``restore``) and summarise them at the end of a step.

``tracer.py`` records; this module holds the data it records, so that comparing, dumping and exchanging
traces between ranks need not import the dispatch mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from opsnn_lab.consistency.gemm_probe import one_thread
from opsnn_lab.consistency.stats import (
    TensorStats,
    dtype_name,
    hash_many,
    stats_from_dict,
    summarize,
    summarize_many,
    tensor_hash,
)

# /2: the hash's position weights became a grid (row weight x column weight); /1 files hash differently
FORMAT = "opsnn_lab.trace/2"

__all__ = ["OpRecord", "Trace", "flatten", "unflatten", "portable", "restore", "summarize_records",
           "summarize_like"]


@dataclass
class OpRecord:
    """One recorded event. ``kind`` is ``op`` (an ATen op), ``module`` (a module's forward outputs) or
    ``grad`` (a parameter's ``.grad`` at the end of the step)."""

    index: int
    phase: str
    kind: str
    op: str
    module_path: str
    location: str
    occurrence: int = 0
    forward_index: int | None = None      # backward op: the forward op whose autograd node ran it
    input_producers: list = field(default_factory=list)  # per tensor input: producing record index or None
    input_stats: list = field(default_factory=list)     # TensorStats for leaf inputs, None for produced ones
    output_stats: list = field(default_factory=list)
    # held tensors (not part of the metadata): flat args/kwargs with their pytree spec, and outputs
    flat_args: list | None = field(default=None, repr=False)
    spec: object = field(default=None, repr=False)
    outputs: list | None = field(default=None, repr=False)
    # summarised as it was recorded, its tensors released: the trace had reached its memory limit
    summarised: bool = False

    @property
    def key(self) -> tuple:
        return (self.phase, self.kind, self.module_path, self.op, self.occurrence)

    def input_tensors(self) -> list[torch.Tensor]:
        return [a for a in (self.flat_args or []) if isinstance(a, torch.Tensor)]

    def meta(self) -> dict:
        d = {k: getattr(self, k) for k in ("index", "phase", "kind", "op", "module_path", "location",
                                           "occurrence", "forward_index", "input_producers", "summarised")}
        d["input_stats"] = [None if s is None else s.as_dict() for s in self.input_stats]
        d["output_stats"] = [s.as_dict() for s in self.output_stats]
        return d


@dataclass
class Trace:
    """The records of one traced step, in execution order."""

    records: list[OpRecord]
    rank: int = 0
    memory_limit: int | None = None  # bytes of tensors the trace could hold; later events kept statistics only
    # (tensor, version at the end of the step) for leaves and gradients held by reference, not copied
    live: list = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def summarised(self) -> int:
        """How many events kept only statistics and hashes (recorded after the memory limit was reached)."""
        return sum(r.summarised for r in self.records)

    def changed_since_recorded(self) -> int:
        """How many held-by-reference leaves (parameters, inputs, gradients) were written after the step."""
        return sum(t._version != v for t, v in self.live)

    def by_key(self) -> dict[tuple, OpRecord]:
        return {r.key: r for r in self.records}

    def save(self, path, tensors: bool = True) -> None:
        """Write the trace to ``path`` (``torch.save``); ``tensors=False`` keeps hashes and statistics only.

        A trace recorded without copying its leaves (``OpTracer(copy_leaves=False)``) refuses to write its
        tensors once an optimizer step or ``zero_grad`` has changed them: they would not be the step's.
        """
        changed = self.changed_since_recorded() if tensors else 0
        if changed:
            raise ValueError(f"tensors=True: {changed} parameters/inputs/gradients this trace holds by reference "
                             "changed after the step (optimizer step, zero_grad); save with tensors=False, or "
                             "save before they change (the checker's reference is always a copy)")
        recs = []
        for r in self.records:
            d = r.meta()
            if tensors and not r.summarised:
                d["flat_args"] = [portable(a) for a in r.flat_args or []]
                d["spec"] = r.spec
                d["outputs"] = [t.detach().cpu() for t in r.outputs or []]
            recs.append(d)
        torch.save({"format": FORMAT, "rank": self.rank, "memory_limit": self.memory_limit, "records": recs}, path)

    @classmethod
    def load(cls, path) -> Trace:
        data = torch.load(path, weights_only=False)
        if isinstance(data, dict) and data.get("format") == "opsnn_lab.trace/1":
            raise ValueError(f"path {str(path)!r} is a trace written before the hash changed (format "
                             "opsnn_lab.trace/1): its hashes cannot match a new trace's; record the reference again")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"path {str(path)!r} is not an opsnn_lab trace file")
        records = []
        for d in data["records"]:
            d = dict(d)
            d["input_stats"] = [None if s is None else stats_from_dict(s) for s in d["input_stats"]]
            d["output_stats"] = [stats_from_dict(s) for s in d["output_stats"]]
            if d.get("flat_args") is not None:
                d["flat_args"] = [restore(a) for a in d["flat_args"]]
            records.append(OpRecord(**d))
        return cls(records, rank=data.get("rank", 0), memory_limit=data.get("memory_limit"))


_MARK = "__torch_attr__"


def portable(a):
    """An argument as ``torch.save`` can write it: tensors on CPU, memory formats/layouts by name."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    if isinstance(a, (torch.memory_format, torch.layout)):
        return (_MARK, str(a).removeprefix("torch."))
    return a


def restore(a):
    if isinstance(a, tuple) and len(a) == 2 and a[0] == _MARK:
        return getattr(torch, a[1])
    return a


def flatten(obj, out: list):
    """Append the leaves of nested lists/tuples/dicts to ``out``; return the structure to rebuild them.

    ATen arguments nest only lists, tuples and (kwargs) dicts; this is ~10x cheaper than pytree.
    """
    kind = type(obj)
    if kind is list or kind is tuple:
        return (kind, [flatten(x, out) for x in obj])
    if kind is dict:
        return (dict, [(k, flatten(v, out)) for k, v in obj.items()])
    out.append(obj)
    return None


def unflatten(flat: list, spec, _pos=None):
    """Inverse of ``flatten``."""
    pos = _pos if _pos is not None else [0]
    if spec is None:
        pos[0] += 1
        return flat[pos[0] - 1]
    kind, items = spec
    if kind is dict:
        return {k: unflatten(flat, s, pos) for k, s in items}
    return kind(unflatten(flat, s, pos) for s in items)



def summarize_records(records: list[OpRecord], reference: Trace | None = None) -> None:
    """Every record's output statistics and its leaf inputs' statistics, each distinct tensor once.

    A module's output is often a reshaped view of its last op's output (same bits, same statistics), so
    contiguous tensors over the same memory are summarised once; all of them go through one
    ``summarize_many`` call, which summarises the small ones together.

    With a ``reference`` (the trace this one will be compared with) every tensor is hashed first, and one
    with the same bits as the reference's tensor in the same place (same record key, position, shape and
    dtype) takes the reference's statistics: only the tensors that differ are summarised in full. A step
    that replays its reference exactly costs its hashes, one pass over each tensor (on CPU).
    """
    records = [rec for rec in records if not rec.summarised]  # summarised as they were recorded
    tensors: list[torch.Tensor] = []
    slot: dict[tuple, int] = {}

    def index(t: torch.Tensor) -> int:
        if not t.is_contiguous():
            tensors.append(t)
            return len(tensors) - 1
        key = (t.data_ptr(), t.numel(), t.dtype, t.device)
        i = slot.get(key)
        if i is None:
            i = slot[key] = len(tensors)
            tensors.append(t)
        return i

    plan = [([index(t) for t in rec.outputs],
             [index(t) if prod is None else None for t, prod in zip(rec.input_tensors(), rec.input_producers)])
            for rec in records]
    stats: list = [None] * len(tensors)
    if reference is not None:
        _reuse(records, plan, tensors, reference, stats)
    todo = [i for i, st in enumerate(stats) if st is None]
    for i, st in zip(todo, summarize_many([tensors[i] for i in todo])):
        stats[i] = st

    def view(i: int, t: torch.Tensor) -> TensorStats:
        st = stats[i]
        return st if st.shape == tuple(t.shape) else replace(st, shape=tuple(t.shape))

    for rec, (outs, ins) in zip(records, plan):
        rec.output_stats = [view(i, t) for i, t in zip(outs, rec.outputs)]
        rec.input_stats = [None if i is None else view(i, t) for i, t in zip(ins, rec.input_tensors())]


def _reuse(records: list[OpRecord], plan: list, tensors: list, reference: Trace, stats: list) -> None:
    """Fill ``stats[i]`` from the reference for every tensor whose every use matches the reference's bits."""
    hashes = hash_many(tensors)
    ref = reference.by_key()
    found: dict[int, TensorStats] = {}
    differs: set[int] = set()

    def match(i: int, t: torch.Tensor, theirs: list, j: int) -> None:
        st = theirs[j] if j < len(theirs) else None
        if st is None or st.hash != hashes[i] or st.shape != tuple(t.shape) or st.dtype != dtype_name(t):
            differs.add(i)
        else:
            found.setdefault(i, st)

    for rec, (outs, ins) in zip(records, plan):
        other = ref.get(rec.key)
        for j, (i, t) in enumerate(zip(outs, rec.outputs)):
            match(i, t, other.output_stats if other is not None else [], j)
        for j, (i, t) in enumerate(zip(ins, rec.input_tensors())):
            if i is not None:
                match(i, t, other.input_stats if other is not None else [], j)
    for i, st in found.items():
        if i not in differs:
            stats[i] = st


def summarize_like(tensors: list[torch.Tensor], theirs: list) -> list[TensorStats]:
    """Statistics of one event's ``tensors`` as it is recorded; where ``theirs[i]`` (the reference's statistics of
    the tensor in the same place, or None) has the same bits, shape and dtype, that one: only the hash is computed.

    One tensor at a time: ``summarize_many`` groups small tensors through a layout cached per set of sizes, made
    for one call per step; called per event, its cache would churn (and hold several copies of the layout)."""
    out = []
    with one_thread():
        for t, st in zip(tensors, theirs):
            if st is None or st.shape != tuple(t.shape) or st.dtype != dtype_name(t):
                out.append(summarize(t))
                continue
            h = tensor_hash(t)
            out.append(st if st.hash == h else summarize(t, known_hash=h))  # the hash is one pass: not twice
    return out
