"""The loss-scale policy on plain floats: one step of it, a replay loop, and the per-step history.

Shared by the live ``DynamicScaler`` and its ``replay`` so that a trace tuned with sliders behaves
exactly like the scaler that later trains with those settings. No tensors here except the flush
fraction, which is one numpy array per replay.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from opsnn_lab.precision.local_scaler import _FLUSH, FP16_MAX

__all__ = ["COLUMNS", "ScalerHistory", "advance", "f32", "replay_events"]

COLUMNS = ("step", "scale", "overflow", "underflow", "underflow_fraction", "amax", "skipped")


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


class ScalerHistory:
    """Every step the scaler saw, stored by column (cheap for 10^5+ steps).

    Columns: ``step``, ``scale`` (used for that step), ``overflow``, ``underflow`` (grew on underflow),
    ``underflow_fraction`` (share of gradient elements that flush to zero in fp16 at that scale),
    ``amax`` (scaled), ``skipped``. ``nonfinite[step]`` names the parameters that held Inf/NaN.
    """

    def __init__(self):
        self.columns: dict[str, list] = {c: [] for c in COLUMNS}
        self.nonfinite: dict[int, list[str]] = {}

    def append(self, row: dict, names: Sequence[str] = ()) -> None:
        for c in COLUMNS:
            self.columns[c].append(row[c])
        if names:
            self.nonfinite[row["step"]] = list(names)

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __getitem__(self, i: int) -> dict:
        row = {c: v[i] for c, v in self.columns.items()}
        row["nonfinite"] = self.nonfinite.get(row["step"], [])
        return row

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def skipped_steps(self) -> list[int]:
        return [s for s, k in zip(self.columns["step"], self.columns["skipped"]) if k]

    def to_dict(self) -> dict[str, list]:
        return {c: list(v) for c, v in self.columns.items()}

    def __repr__(self) -> str:
        return f"ScalerHistory({len(self)} steps, {len(self.skipped_steps)} skipped)"


def replay_events(cfg: tuple, state: tuple, events: Iterable, *, underflow_threshold: float | None,
                  patience: int, first_step: int = 0) -> dict[str, list]:
    """The loop of ``DynamicScaler.replay`` (see its docstring for the event format) on plain floats.

    ``cfg`` as in :func:`advance`; ``state`` = ``(scale, growth_tracker, hysteresis_tracker, pinned)``.
    """
    scale, tracker, hyst, pinned = state
    thr = underflow_threshold
    out = {c: [] for c in (*COLUMNS, "pinned")}
    hists: list = []
    for i, ev in enumerate(events):
        amax, forced, hist = _parse_event(ev)
        if amax is None:
            over, scaled = forced, math.nan
        else:
            scaled = amax * scale
            over = forced or not (scaled <= FP16_MAX)
        under = (not over) and thr is not None and amax is not None and scaled < thr
        if over and scale <= cfg[4]:
            pinned += 1
        else:
            pinned = 0
        out["step"].append(first_step + i)
        out["scale"].append(scale)
        out["overflow"].append(over)
        out["underflow"].append(under)
        out["underflow_fraction"].append(0.0)
        if hist is not None:
            hists.append((i, hist))
        out["amax"].append(scaled)
        out["skipped"].append(over or under)
        out["pinned"].append(pinned >= patience)
        scale, tracker, hyst = advance(cfg, scale, tracker, hyst, over, under)
    if hists:  # the flush fraction never feeds back into the scale: compute it afterwards, vectorised
        for i, frac in _hist_flush(hists, out["scale"]):
            out["underflow_fraction"][i] = frac
    return out


def advance(cfg: tuple, scale: float, tracker: int, hyst: int, overflow: bool, underflow: bool):
    """One step of the loop policy on plain floats: ``(scale, growth_tracker, hysteresis_tracker)``.

    GradScaler's ``_amp_update_scale_`` plus Megatron's hysteresis and the seed's underflow growth.
    """
    growth, backoff, interval, hysteresis, min_s, max_s = cfg
    if overflow:
        hyst -= 1
        if hyst <= 0:
            scale = max(f32(scale * backoff), min_s)
        return scale, 0, hyst
    if underflow:
        tracker = interval - 1  # grow now, as if the interval had just completed
    tracker += 1
    if tracker >= interval:
        new = f32(scale * growth)
        if math.isfinite(new):
            scale = min(new, max_s)
        return scale, 0, hysteresis
    return scale, tracker, hyst


def _parse_event(ev):
    if isinstance(ev, bool):
        return None, ev, None
    if isinstance(ev, (int, float)):
        return float(ev), False, None
    if isinstance(ev, Mapping):
        amax = ev.get("amax")
        hist = ev.get("hist")
        if hist is not None:
            hist = (hist[0], hist[1], ev.get("zeros", 0))
        return (None if amax is None else float(amax)), bool(ev.get("overflow", False)), hist
    raise TypeError(f"events must hold floats (amax), bools (overflow) or dicts, got {type(ev).__name__}")


def _hist_flush(hists: list, scales: list[float]):
    """``(index, fraction)`` of elements whose log2|g| + log2(scale) lands at or below fp16's flush point.

    Events sharing one edges object are done as one (events x bins) array; within a bin the magnitudes
    are taken as log-uniform.
    """
    groups: dict[int, list] = {}
    for i, (edges, counts, zeros) in hists:
        groups.setdefault(id(edges), []).append((i, edges, counts, zeros))
    flush_log2 = math.log2(_FLUSH[torch.float16])
    for rows in groups.values():
        edges = np.asarray(rows[0][1], dtype=np.float64)
        idx = [r[0] for r in rows]
        counts = np.asarray([np.asarray(r[2], dtype=np.float64) for r in rows])
        if counts.ndim != 2 or counts.shape[1] != len(edges) - 1:
            raise ValueError(f"events: a hist needs len(edges) == len(counts) + 1, got {len(edges)} edges")
        zeros = np.asarray([r[3] for r in rows], dtype=np.float64)
        cut = flush_log2 - np.log2(np.asarray([scales[i] for i in idx]))[:, None]
        lo, hi = edges[None, :-1], edges[None, 1:]
        share = np.clip((cut - lo) / (hi - lo), 0.0, 1.0)
        total = counts.sum(1) + zeros
        flushed = (counts * share).sum(1)
        frac = np.divide(flushed, total, out=np.zeros_like(flushed), where=total > 0)
        yield from zip(idx, frac.tolist())
