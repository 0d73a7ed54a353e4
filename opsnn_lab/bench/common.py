"""Timing, tables and JSON output shared by every benchmark."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

__all__ = ["median_time", "Timer", "machine_info", "write_json", "format_table", "bench_dir", "sync"]


def sync(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 7,
                device: torch.device | str | None = None) -> float:
    """Median wall time of ``fn()`` in seconds after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], *, warmup: int = 2, repeat: int = 7,
                        device=None) -> dict[str, float]:
    """Median times of several variants, measured round-robin so load drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def machine_info() -> dict:
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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
