"""Measuring, below every layer that reports a figure: activation bytes and interleaved median times.

Activation memory is counted exactly: ``saved_tensors_hooks`` sees every tensor a forward saves; we
count unique storages (two views of one buffer are one allocation) and leave out parameters and
buffers, which exist whether or not a forward runs. The figure is the same on every device and every
run, so it is the headline memory number on CPU.

Time is a ratio of medians taken in the same process, never an absolute: ``interleaved_medians``
measures several variants round-robin so load drift on a shared machine hits them all alike.

``fusion.measure`` and the benchmarks (``opsnn_lab.bench``, which re-exports ``activation_bytes``) use
this module; it imports nothing from opsnn_lab.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["activation_bytes", "saved_tensors_report", "SavedTensorsReport", "pack_detached", "peak_bytes",
           "median_time", "interleaved_medians", "sync"]


@dataclass
class SavedTensorsReport:
    total_bytes: int = 0
    tensors: list[dict] = field(default_factory=list)  # one row per unique storage
    output: object = None

    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.tensors:
            out[row["dtype"]] = out.get(row["dtype"], 0) + row["bytes"]
        return out


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), t.device.type, t.device.index) if s.data_ptr() else ("id", id(s))
    except (RuntimeError, NotImplementedError):  # sparse / functional wrappers without storage
        return ("id", id(t))


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def saved_tensors_report(fn: Callable[[], object], exclude: tuple[torch.Tensor, ...] = (),
                         where: Callable[[], str] | None = None) -> SavedTensorsReport:
    """Run ``fn()`` and describe every unique storage autograd holds for backward once it returns.

    Parameters (``nn.Parameter``) and tensors in ``exclude`` (e.g. module buffers) are
    not activations and are left out. Tensors saved as views of a parameter (``weight.t()``)
    are recognised through their storage and left out too.

    What ``fn`` saved for a computation it dropped, its graph freed before it returns (RT-DETR's last box
    refinement, a state-space model's discarded state), is not held for backward and is left out: counted, it made
    the figure move between runs, by a storage whose address a later save took or not. So ``fn`` returns what holds
    the graph (the output, the loss), as a training step holds it until its backward.

    ``where``: called at each save, its answer kept as the row's ``"where"`` (the module running:
    ``fusion.activation_bytes_by_module``); a storage saved more than once is the first held save's.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    report = SavedTensorsReport()
    excluded = {_storage_key(t) for t in exclude}
    param_storages: set = set()
    saves: list[tuple] = []  # (storage key, weak reference to what pack returned, row)

    # The hooks stay with every tensor saved under them for as long as its autograd graph lives: ``pack`` holds
    # plain values and weak references only, never ``report`` (whose ``output`` holds that graph), and returns a
    # detached alias (``pack_detached``): either would make a cycle through C++ that no collector sees. The alias
    # lives as long as the graph node saving it: dead once ``fn`` returns, it was dropped with its computation
    def pack(t: torch.Tensor):
        alias = pack_detached(t)
        if isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter):
            param_storages.add(_storage_key(t))
            return alias
        key = _storage_key(t)
        if key not in excluded:
            row = {"key": key, "shape": tuple(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                   "bytes": _nbytes(t)}
            if where is not None:
                row["where"] = where()
            saves.append((key, weakref.ref(alias), row))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        report.output = fn()
    rows: dict = {}
    for key, alias, row in saves:  # a freed storage's address may have been taken by a later save: held ones only
        if alias() is not None and key not in param_storages:
            rows.setdefault(key, row)  # views of parameters (a Linear's transposed weight) share their storage
    report.tensors = list(rows.values())
    report.total_bytes = sum(r["bytes"] for r in report.tensors)
    return report


def pack_detached(t: torch.Tensor) -> torch.Tensor:
    """What a counting ``saved_tensors_hooks`` pack returns: ``t.detach()``, the same storage and version counter.
    Returning ``t`` itself keeps an op's saved OUTPUT (``exp``, ``rsqrt``, ``sigmoid``) alive from its own autograd
    node, a cycle through C++ that Python's collector cannot see: the whole forward would never be freed."""
    return t.detach()


def activation_bytes(fn: Callable[[], object], exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of unique storages saved for backward by ``fn()``, without parameters.

    ``activation_bytes(lambda: model(x))``. Pass module buffers in ``exclude`` if the
    model saves them (BatchNorm's running stats are not saved, so usually none are).
    """
    return saved_tensors_report(fn, exclude).total_bytes


# --------------------------------------------------------------------------- peak
def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensor storages allocated by ``fn()`` and alive at once, on any device.

    For a training step: ``peak_bytes(lambda: loss_fn().backward())``. Every ATen op's outputs are seen
    through a ``TorchDispatchMode`` (backward too, and the ``.grad`` tensors autograd creates: set them to
    None first to count them); a storage counts from the op that creates it until it is freed (noted at the
    next op, before that op allocates). Storages that exist before (parameters, inputs, their views and
    in-place results) are not counted. CPU and CUDA alike, unlike the CUDA allocator's statistics.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live: dict = {}
    state = {"now": 0, "peak": 0}

    class _Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for key in [k for k, (ref, _) in live.items() if ref.expired()]:
                state["now"] -= live.pop(key)[1]
            inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    key = _storage_key(t)
                    if key not in inputs and key not in live:
                        live[key] = (StorageWeakRef(t.untyped_storage()), _nbytes(t))
                        state["now"] += live[key][1]
            state["peak"] = max(state["peak"], state["now"])
            return out

    with _Live():
        fn()
    return state["peak"]


# --------------------------------------------------------------------------- time
def sync(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _per_call(fn: Callable[[], object], calls: int, device) -> float:
    """Wall time of ``calls`` back-to-back calls of ``fn()`` (synchronised), per call, in seconds."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls


def median_time(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 7,
                device: torch.device | str | None = None) -> float:
    """Median wall time of ``fn()`` in seconds after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(_per_call(fn, 1, device) for _ in range(repeat))


def interleaved_medians(fns: dict[str, Callable[[], object]], *, warmup: int = 2, repeat: int = 7,
                        device=None, min_round_s: float = 0.0) -> dict[str, float]:
    """Median times per call of several variants, measured round-robin so load drift hits all alike.

    ``min_round_s > 0``: one timed call of each variant after the warm-up sets how many calls a round makes
    (the same for every variant, enough for the fastest one to run ``min_round_s``), so a 1 ms op is timed
    over rounds long enough for the clock and the scheduler, not one call at a time."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    calls = 1
    if min_round_s > 0:
        fastest = min(_per_call(fn, 1, device) for fn in fns.values())
        calls = max(1, math.ceil(min_round_s / max(fastest, 1e-9)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            times[k].append(_per_call(fn, calls, device))
    return {k: statistics.median(v) for k, v in times.items()}
