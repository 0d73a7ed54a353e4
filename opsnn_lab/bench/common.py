"""Timing, tables and JSON output shared by every benchmark; each JSON says where it ran (``machine``)."""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from opsnn_lab.bench.machine import machine_info, machine_line
from opsnn_lab.measuring import interleaved_medians, median_time, peak_bytes, sync

__all__ = ["median_time", "interleaved_medians", "Timer", "machine_info", "machine_line", "write_json", "format_table",
           "bench_dir", "sync", "keeps_threads", "step_peak_bytes"]


def step_peak_bytes(step: Callable[[], object], tensors: Iterable[torch.Tensor]) -> int:
    """``peak_bytes(step)`` with the ``.grad`` of every tensor in ``tensors`` that requires grad set to None first,
    as after ``zero_grad(set_to_none=True)``: the gradients the step makes count in its peak."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.grad = None
    return peak_bytes(step)


def keeps_threads(main):
    """A benchmark's ``main()`` may set torch's intra-op thread count for its run (``--threads``, or one thread
    for tiny tensors); called in-process (a notebook, a test), it hands the caller's count back when it ends."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        import torch

        threads = torch.get_num_threads()
        try:
            return main(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def bench_dir(out: str | os.PathLike | None = None) -> Path:
    path = Path(out or os.environ.get("OPSNN_BENCH_DIR", "build/bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, data: dict, out: str | os.PathLike | None = None) -> Path:
    path = bench_dir(out) / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(), **data}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3f") -> str:
    """A plain-text (also valid markdown) table of ``rows``."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def fmt(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep, *(line(r) for r in cells)])
